#!/usr/bin/env bash
# Serving scenarios on the H200 (one device call): Llama-3-8B-shaped dummy weights, bf16, the NEO paper's
# A10G trace. (a) an emulated 24 GB GPU, (c) the full H200. Results in $OUT.
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results/h200-run}"
mkdir -p "$OUT"
TOKENIZER="${TOKENIZER:-.carry/tokenizer}"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
  python3 -m neo_backend build-kernel
  step 330 python3 bench/serving.py --gpu-memory-gb 24 --rates 4 8 12 16 --num-requests 160 \
      --policies never auto --cpu-kv-cache-gb 32 --tokenizer "$TOKENIZER" --json "$OUT/serving_a_24gb.json"
  step 200 python3 bench/serving.py --rates 8 16 --num-requests 160 --policies never auto \
      --cpu-kv-cache-gb 16 --tokenizer "$TOKENIZER" --json "$OUT/serving_c_h200.json"
  step 200 python3 bench/contention.py --gpu-memory-gb 24 --rate 6 --policies auto always never \
      --warmup-seconds 8 --phase-seconds 12 --cpu-kv-cache-gb 32 --tokenizer "$TOKENIZER" \
      --json "$OUT/contention.json"
} 2>&1 | tee "$OUT/serving_log.txt"
