"""docker-compose.yml against the Compose Specification JSON schema, and its consistency with the Makefile.

No Docker engine runs here, so the file is validated the way `docker compose config` starts: YAML, then the
compose-spec schema (tests/data/compose-spec.json, vendored from PyPI `check-jsonschema==0.39.0`, which ships it
under check_jsonschema/builtin_schemas/vendor/; Apache-2.0, licence beside it).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from neo_backend.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_FILE = ROOT / "docker" / "neo.env"
SCHEMA = Path(__file__).resolve().parents[1] / "data" / "compose-spec.json"
SERVER_ADDRESS_VARS = {"NEO_HOST", "NEO_HTTP_PORT", "NEO_GRPC_PORT", "NEO_METRICS_PORT"}


class ComposeInvalid(Exception):
    pass


def validate_compose(path: Path) -> dict[str, Any]:
    """Parse a compose file and check it against the compose-spec schema; raise ComposeInvalid listing errors."""
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ComposeInvalid(f"{path}: not YAML: {exc}") from None
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        raise ComposeInvalid(
            "\n".join(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)
        )
    return document


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def makefile_recipe(target: str) -> str:
    match = re.search(rf"^{target}:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no {target} target"
    return match.group(1)


def makefile_default(variable: str) -> str:
    match = re.search(rf"^{variable} \?=[ \t]*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile does not define {variable} ?="
    return match.group(1).strip()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return validate_compose(COMPOSE)


def test_vendored_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA.read_text()))


def test_compose_file_matches_the_compose_spec(compose):
    assert set(compose["services"]) >= {"triton", "locust"}


BREAKAGES = {
    "ports as a mapping": ('    ports:\n      - "8000:8000"', "    ports:\n      http: 8000"),
    "unknown service key": ("    shm_size: 2gb", "    shm_size: 2gb\n    gpus_please: yes"),
    "bad depends_on condition": ("condition: service_healthy", "condition: when_ready"),
    "GPU capabilities not a list": ("capabilities: [gpu]", "capabilities: gpu"),
    "services as a list": ("services:\n  triton:", "services:\n- triton:"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_validation_fails_on_a_broken_copy(tmp_path, name):
    old, new = BREAKAGES[name]
    text = COMPOSE.read_text()
    assert old in text, f"breakage {name!r} no longer applies to docker-compose.yml"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    with pytest.raises(ComposeInvalid):
        validate_compose(broken)


def test_triton_service_runs_make_serve_with_the_env_file_knobs(compose):
    triton = compose["services"]["triton"]
    serve = makefile_recipe("serve").split()
    assert triton["command"][1:] == serve[1:], "triton command differs from the Makefile's serve recipe"
    assert triton["env_file"] == "docker/neo.env"
    env = read_env_file(ENV_FILE)
    knobs = {k for k in env if k not in SERVER_ADDRESS_VARS}
    unknown = {k for k in knobs if k[4:].lower() not in EngineConfig.field_names() or not k.startswith("NEO_")}
    assert not unknown, f"docker/neo.env sets variables that are no engine knob: {sorted(unknown)}"
    EngineConfig.from_env({k: v for k, v in env.items() if k in knobs})  # values parse and validate
    assert env["NEO_HOST"] == "0.0.0.0"


def test_triton_ports_health_check_and_gpu(compose):
    triton = compose["services"]["triton"]
    env = read_env_file(ENV_FILE)
    published = {p.split(":")[-1] for p in triton["ports"]}
    assert (
        published == {env["NEO_HTTP_PORT"], env["NEO_GRPC_PORT"], env["NEO_METRICS_PORT"]} == {"8000", "8001", "8002"}
    )
    probe = " ".join(triton["healthcheck"]["test"])
    assert f":{env['NEO_HTTP_PORT']}/v2/health/ready" in probe
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)


def test_locust_service_matches_make_loadtest(compose):
    locust = compose["services"]["locust"]
    assert locust["depends_on"]["triton"]["condition"] == "service_healthy"
    recipe = makefile_recipe("loadtest")
    command = " ".join(locust["command"])
    assert "-m loadtest" in recipe and "-m loadtest" in command
    make_flags = set(re.findall(r"--[a-z-]+", recipe))
    assert make_flags == set(re.findall(r"--[a-z-]+", command)), "locust service flags differ from make loadtest"
    for variable in ("DURATION", "USERS", "WORKLOAD", "RATE", "API"):
        assert f"$(${variable})" in recipe or f"$({variable})" in recipe
        assert f"$${variable}" in command or f"$${{{variable}" in command, f"{variable} is not passed on"
        default = makefile_default(variable)
        assert locust["environment"][variable] == f"${{{variable}:-{default}}}", (
            f"{variable} default differs from the Makefile"
        )
    assert locust["environment"]["NEO_HOST"] == "triton"
    assert (locust["environment"]["NEO_OPENAI_HOST"], locust["environment"]["NEO_OPENAI_PORT"]) == ("openai", "9000")
    ui = compose["services"]["locust-ui"]
    assert ui["profiles"] == ["ui"] and "loadtest/locustfile.py" in shlex.join(ui["command"])


def test_openai_service_fronts_the_triton_service(compose):
    services = compose["services"]
    openai, triton = services["openai"], services["triton"]
    assert openai["command"][1:] == ["-m", "openai_frontend"]
    assert openai["environment"]["NEO_OPENAI_TRITON_URL"] == f"triton:{read_env_file(ENV_FILE)['NEO_GRPC_PORT']}"
    assert openai["ports"] == [f"{openai['environment']['NEO_OPENAI_PORT']}:9000"]
    assert ":9000/health" in " ".join(openai["healthcheck"]["test"])
    assert openai["depends_on"]["triton"]["condition"] == "service_healthy"
    assert triton["environment"]["NEO_OPENAI_PORT"] == "off", "the triton service must not start a second gateway"
    assert services["locust"]["depends_on"]["openai"]["condition"] == "service_healthy"
