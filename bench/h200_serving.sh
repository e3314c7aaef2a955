#!/usr/bin/env bash
# Serving scenarios on the H200: Llama-3-8B-shaped dummy weights, bf16, the NEO paper's A10G trace.
#   bash bench/h200_serving.sh serving      # (a) an emulated 24 GB GPU, (c) the full H200   (one run)
#   bash bench/h200_serving.sh contention   # auto vs always under CPU hogs, 24 GB emulated  (another run)
# Results in $OUT; TOKENIZER names a tokenizer directory, as for bench/h200.sh.
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results/tmp}"
mkdir -p "$OUT"
TOKENIZER="${TOKENIZER:?set TOKENIZER to a tokenizer directory: the dummy shapes have none}"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
{
  python3 -m neo_backend build-kernel
  case "${1:-serving}" in
    serving)
      step 260 python3 bench/serving.py --gpu-memory-gb 24 --rates 10 14 18 --num-requests 100 \
          --policies never auto --cpu-kv-cache-gb 32 --tokenizer "$TOKENIZER" --json "$OUT/h200_serving_a_24gb.json"
      step 230 python3 bench/serving.py --rates 8 16 --num-requests 100 --policies never auto \
          --cpu-kv-cache-gb 16 --tokenizer "$TOKENIZER" --json "$OUT/h200_serving_c_full.json" ;;
    contention)
      step 300 python3 bench/contention.py --gpu-memory-gb 24 --rate 12 --policies auto always never \
          --warmup-seconds 6 --phase-seconds 10 --cpu-kv-cache-gb 32 --tokenizer "$TOKENIZER" \
          --json "$OUT/h200_contention_24gb_memory_hogs_rate12_all_cores.json" ;;
  esac
} 2>&1 | tee "$OUT/serving_log_${1:-serving}.txt" | grep -v "INFO\|WARNING"
