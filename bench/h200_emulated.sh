#!/usr/bin/env bash
# The NEO paper's small-GPU settings emulated on the H200: an 8-SM partition (`--gpu-sm-count 8`, ~640 GB/s and
# ~55 TFLOP/s, an A10G-class device) and a memory budget, dummy bf16 weights, the paper's A10G trace. Steps, in
# the order given (each a few minutes; d, d_offline and each (e) step fill most of a 10-minute call):
#   bash bench/h200_emulated.sh tests roofline c   # CUDA tests of the partition, its roofline, (c) full H200
#   bash bench/h200_emulated.sh d d_offline        # (d) A10G-class: Llama-3-8B shape, 24 GB, never and auto
#   bash bench/h200_emulated.sh e_light            # (e) T4-class memory: Llama-2-7B shape (MHA), 16 GB; the sweep
#   bash bench/h200_emulated.sh e_knee             # in one call a step, each rate's trace long enough for GPU-only's
#   bash bench/h200_emulated.sh e_saturated        # queue to build where it cannot keep up, then one report of the
#                                                  # parts run:
#     python3 bench/serving.py --merge .../h200_serving_e_t4mem_{light,knee,saturated}.json --json REPORT
#   bash bench/h200_emulated.sh e_offline          # (e) offline
#   bash bench/h200_emulated.sh e_always e_sequential  # (e): never against always; its sequential iterations
#   bash bench/h200_emulated.sh e_swap             # (e): one request's swap, alone and beside CPU attention
# (e) runs `auto` at `cpu_latency_slack` 3 (E_SLACK=K for another) on 8 SMs, twice a T4's bandwidth: the
# smallest partition. The policies of a setting share one engine (bench/serving.py); settings run one after
# another, as every partition is the device's first 8 SMs.
# Results in $OUT. TOKENIZER names a tokenizer directory, as for bench/h200.sh.
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results/tmp}"
mkdir -p "$OUT"
TOKENIZER="${TOKENIZER:?set TOKENIZER to a tokenizer directory: the dummy shapes have none (bench/h200.sh says which)}"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "=== exit $?"; }
SERVE=(python3 bench/serving.py --policies never auto --gpu-sm-count 8 --tokenizer "$TOKENIZER")
SERVE_E=("${SERVE[@]}" --model bench/configs/llama2-7b --load-format dummy --gpu-memory-gb 16 --cpu-kv-cache-gb 48 \
    --cpu-latency-slack "${E_SLACK:-3}" --warmup-seconds 20)
serve_e() {  # NAME LIMIT SECONDS_PER_RATE RATE...: one part of (e)'s sweep, its report and iteration log
  local name=$1 limit=$2 seconds=$3; shift 3
  step "$limit" "${SERVE_E[@]}" --rates "$@" --seconds-per-rate "$seconds" \
      --iteration-log "$OUT/h200_serving_e_t4mem_${name}_iterations.jsonl" \
      --json "$OUT/h200_serving_e_t4mem_${name}.json"
}
{
  python3 -m neo_backend build-kernel
  for what in "$@"; do
    case "$what" in
      tests)
        step 180 python3 -m pytest -q -x -s -p no:cacheprovider tests/cuda/test_cuda.py -k "partition or greedy or swap" ;;
      roofline)
        step 140 python3 bench/engine.py --roofline --gpu-sm-count 8 --tokenizer "$TOKENIZER" \
            --json "$OUT/h200_engine_roofline_8sm.json" ;;
      c)
        step 170 python3 bench/serving.py --rates 8 16 --num-requests 60 --policies never auto --cpu-kv-cache-gb 16 \
            --tokenizer "$TOKENIZER" --json "$OUT/h200_serving_c_full.json" ;;
      d)
        step 370 "${SERVE[@]}" --gpu-memory-gb 24 --rates 0.5 1.5 2.5 --seconds-per-rate 36 --warmup-seconds 10 \
            --cpu-kv-cache-gb 32 --json "$OUT/h200_serving_d_a10g.json" ;;
      d_offline)
        step 300 "${SERVE[@]}" --gpu-memory-gb 24 --rates --offline 40 --cpu-kv-cache-gb 32 \
            --json "$OUT/h200_serving_d_a10g_offline.json" ;;
      e_light) serve_e light 540 90 0.1 0.33 ;;
      e_knee) serve_e knee 520 120 0.35 ;;
      e_saturated) serve_e saturated 540 90 0.4 0.5 ;;
      e_offline)
        step 280 "${SERVE_E[@]}" --rates --offline 12 --json "$OUT/h200_serving_e_t4mem_offline.json" ;;
      e_swap)
        step 120 python3 bench/swap.py --device cuda --model bench/configs/llama2-7b --context 1100 --busy-host \
            --json "$OUT/h200_swap_e.json" ;;
      e_always)
        step 330 python3 bench/serving.py --policies never always --gpu-sm-count 8 --warmup-seconds 10 \
            --tokenizer "$TOKENIZER" --model bench/configs/llama2-7b --load-format dummy --gpu-memory-gb 16 \
            --rates 0.5 --seconds-per-rate 45 --offline 12 --cpu-kv-cache-gb 48 \
            --json "$OUT/h200_serving_e_t4mem_always.json" ;;
      e_sequential)
        step 130 python3 bench/pipeline_overlap.py --model bench/configs/llama2-7b --load-format dummy \
            --gpu-sm-count 8 --num-gpu-blocks 185 --gpu-decodes 2 --context 1100 --cpu-kv-cache-gb 8 \
            --cpu-decodes 1 2 4 8 --sequential --tokenizer "$TOKENIZER" \
            --json "$OUT/h200_pipeline_sequential_e_8sm.json" ;;
    esac
  done
} 2>&1 | tee "$OUT/log_$(IFS=_; echo "$*").txt" | grep -v "INFO\|WARNING"
