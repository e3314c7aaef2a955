#!/usr/bin/env bash
# One device call on the lent H200 machine: builds the CPU kernel, checks the CUDA paths, then times the
# engine against its roofline (with a kernel profile of the prefill and decode steps) and the pipeline overlap.
# Logs and JSON land in $OUT; figures afterwards with bench/plots.py (its flags name the files).
# Run from the repository root:  bash bench/h200.sh   (OUT defaults to bench/results/h200-run)
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results/h200-run}"
mkdir -p "$OUT"
# The dummy 8B shape has no tokenizer; give it one (the default model's, converted and cached by `make model`):
#   mkdir -p .carry && cp -r ~/.cache/neo-triton/tokenizers/*/ .carry/tokenizer   (here, before the call;
#   `.carry/` in .git/info/exclude, named in the device call's carry list)
TOKENIZER="${TOKENIZER:-.carry/tokenizer}"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
  step 90 python3 -m neo_backend build-kernel
  step 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py
  step 150 python3 bench/engine.py --roofline --profile --num-requests 8 --prompt-len 1000 --output-len 4 \
      --tokenizer "$TOKENIZER" --json "$OUT/engine.json"
  step 150 python3 bench/pipeline_overlap.py --tokenizer "$TOKENIZER" --json "$OUT/pipeline.json"
} 2>&1 | tee "$OUT/log.txt" | grep -v "^INFO\| INFO "
