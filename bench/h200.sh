#!/usr/bin/env bash
# One device call on the lent H200 machine: builds the CPU kernel, checks the CUDA paths, then times the
# kernel, the engine against its roofline, the pipeline overlap, and transformers on the same GPU
# (bench/hf_peer.py). Logs and JSON land in $OUT; figures afterwards with bench/plots.py (its flags name the files).
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
  step 120 python3 -m neo_backend build-kernel
  step 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py
  step 170 python3 bench/engine.py --roofline --tokenizer "$TOKENIZER" --json "$OUT/engine.json"
  step 170 python3 bench/pipeline_overlap.py --tokenizer "$TOKENIZER" --json "$OUT/pipeline.json"
  step 240 python3 bench/hf_peer.py --tokenizer "$TOKENIZER" --json "$OUT/hf_peer.json"
} 2>&1 | tee "$OUT/log.txt" | grep -v "^INFO\| INFO "
