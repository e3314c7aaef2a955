#!/usr/bin/env bash
# The GPU path on the H200 machine in one go: builds the CPU kernel, checks the CUDA paths, then times the
# engine against its roofline (with a kernel profile of the prefill and decode steps), where its decode step's
# and prefill's time goes (bench/breakdown.py), what a prompt of a new length costs (bench/prefill_lengths.py) and
# the pipeline overlap.
# Logs and JSON land in $OUT; figures afterwards with bench/plots.py (its flags name the files).
# Run from the repository root:  bash bench/h200.sh   (OUT defaults to bench/results/tmp)
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results/tmp}"
mkdir -p "$OUT"
# The dummy 8B shape has no tokenizer; TOKENIZER names one: the default model's, converted and cached by
# `make model` in ~/.cache/neo-triton/tokenizers/<key>/.
TOKENIZER="${TOKENIZER:?set TOKENIZER to a tokenizer directory: the dummy shapes have none}"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
  step 90 python3 -m neo_backend build-kernel
  step 150 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda.py
  step 150 python3 bench/engine.py --roofline --profile --num-requests 8 --prompt-len 1000 --output-len 4 \
      --tokenizer "$TOKENIZER" --json "$OUT/h200_engine_roofline.json"
  step 150 python3 bench/breakdown.py --tokenizer "$TOKENIZER" --json "$OUT/h200_breakdown.json"
  step 120 python3 bench/prefill_lengths.py --tokenizer "$TOKENIZER" --json "$OUT/h200_prefill_lengths.json"
  step 150 python3 bench/pipeline_overlap.py --tokenizer "$TOKENIZER" --json "$OUT/h200_pipeline_overlap.json"
} 2>&1 | tee "$OUT/log.txt" | grep -v "^INFO\| INFO "
