#!/usr/bin/env bash
# The NEO paper's small-GPU settings emulated on the H200: an 8-SM partition (`--gpu-sm-count 8`, ~640 GB/s and
# ~55 TFLOP/s, an A10G-class device) and a memory budget, dummy bf16 weights, the paper's A10G trace.
#   bash bench/h200_emulated.sh check     # CUDA tests, the partition's roofline, a short rerun of (c) full H200
#   bash bench/h200_emulated.sh sweep1    # never for (d) and (e) side by side, auto for (d)       (one call)
#   bash bench/h200_emulated.sh sweep2    # auto for (e), on the whole host                         (another)
# (d) A10G-class: Llama-3-8B shape, 24 GB. (e) T4-class memory: Llama-2-7B shape (MHA), 16 GB, 8 SMs: twice a
# T4's bandwidth, the smallest partition. Processes that run side by side each have an 8-SM partition of their
# own and their own CPUs (taskset): the GPU-only engines two cores each, an engine with offloading the rest.
# Results in $OUT; the tokenizer is carried as in bench/h200.sh.
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results/h200-run}"
mkdir -p "$OUT"
TOKENIZER="${TOKENIZER:-.carry/tokenizer}"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
D=(--gpu-memory-gb 24 --gpu-sm-count 8 --rates 0.5 1 1.5 2 2.5 --seconds-per-rate 55 --warmup-seconds 15
   --offline 80 --cpu-kv-cache-gb 32 --tokenizer "$TOKENIZER")
E=(--model bench/configs/llama2-7b --load-format dummy --gpu-memory-gb 16 --gpu-sm-count 8
   --rates 0.1 0.2 0.3 0.45 --seconds-per-rate 80 --warmup-seconds 15 --offline 24 --cpu-kv-cache-gb 48
   --tokenizer "$TOKENIZER")
{
  python3 -m neo_backend build-kernel
  case "${1:-check}" in
    check)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c 'import torch; print(torch.__version__)'
      step 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "greedy or partition or logits"
      step 140 python3 bench/engine.py --roofline --gpu-sm-count 8 --tokenizer "$TOKENIZER" --json "$OUT/engine_8sm.json"
      step 170 python3 bench/serving.py --rates 8 16 --num-requests 60 --policies never auto --cpu-kv-cache-gb 16 \
          --tokenizer "$TOKENIZER" --json "$OUT/serving_c_full.json" ;;
    sweep1)
      step 570 taskset -c 12,13 python3 bench/serving.py --policies never "${D[@]}" --json "$OUT/d_never.json" \
          > "$OUT/d_never.txt" 2>&1 &
      step 570 taskset -c 14,15 python3 bench/serving.py --policies never "${E[@]}" --json "$OUT/e_never.json" \
          > "$OUT/e_never.txt" 2>&1 &
      step 570 taskset -c 0-11 python3 bench/serving.py --policies auto "${D[@]}" --json "$OUT/d_auto.json"
      wait; cat "$OUT/d_never.txt" "$OUT/e_never.txt" ;;
    sweep2)
      step 570 python3 bench/serving.py --policies auto "${E[@]}" --json "$OUT/e_auto.json" ;;
  esac
} 2>&1 | tee "$OUT/log_${1:-check}.txt" | grep -v "INFO\|WARNING"
