#!/usr/bin/env bash
# The whole stack as a user runs it, under load: `python -m neo_backend serve` (Triton with the neo model and the
# OpenAI gateway), the project's locust load test over Triton gRPC, open loop, at each rate of RATES, the engine's
# Prometheus gauges before and after, readiness polled every second under the load, then SIGTERM and the time the
# stack takes to stop. With COMPARE=1 (and NEO_MODEL set), the in-process bench/serving.py afterwards, with the
# same knobs, replaying the very load each rate sent (arrival times, prompt and output lengths): the ratio of the
# two tokens/s is what the Triton layer costs.
#
#   RATES="0.5 1.5" DURATION=60s WORKLOAD=a10g bash bench/stack.sh
#
# LOADTEST_ARGS adds flags of `python -m loadtest` (e.g. "--output-tokens 8" for the fixed workload on a CPU).
#
# Engine knobs come as NEO_* variables, as for `make serve` (e.g. NEO_MODEL=bench/configs/llama3-8b
# NEO_LOAD_FORMAT=dummy NEO_TOKENIZER=DIR NEO_GPU_SM_COUNT=8 NEO_NUM_GPU_BLOCKS=3606 NEO_OFFLOAD_POLICY=auto).
# Logs and the load test's results land in $OUT (default bench/results/tmp/stack). Exit status 0 only when the
# stack became ready and stayed ready, every request succeeded, the KV pools drained, and the stack stopped
# cleanly within 15 s.
set -u
PY="${PYTHON:-python3}"
RATES="${RATES:-0.5 1.5}"
DURATION="${DURATION:-60s}"
WORKLOAD="${WORKLOAD:-a10g}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-900}"
OUT="${OUT:-bench/results/tmp}/stack"
mkdir -p "$OUT"
HOST="${NEO_HOST:-127.0.0.1}"
HEALTH="http://$HOST:${NEO_HTTP_PORT:-8000}/v2/health/ready"
METRICS="http://$HOST:${NEO_METRICS_PORT:-8002}/metrics"
status=0
fail() { echo "FAIL: $*"; status=1; }
gauges() { curl -s --max-time 5 "$METRICS" | grep -E '^neo_(requests|kv_blocks_used|kv_blocks_total)' ; }

setsid "$PY" -m neo_backend serve >"$OUT/serve.log" 2>&1 &
SERVE_PID=$!
deadline=$((SECONDS + READY_TIMEOUT_S))
until curl -sf --max-time 2 "$HEALTH" >/dev/null; do
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then fail "the stack exited before it was ready"; tail -40 "$OUT/serve.log"; exit 1; fi
  if ((SECONDS > deadline)); then fail "not ready within ${READY_TIMEOUT_S}s"; kill -TERM -- -"$SERVE_PID"; exit 1; fi
  sleep 2
done
echo "=== ready after ${SECONDS}s; the log's last lines:"
tail -8 "$OUT/serve.log"
echo "=== gauges before the load"; gauges | tee "$OUT/metrics_before.txt"

# readiness polled every second under the load: each failed poll is a line in not_ready.log
: >"$OUT/not_ready.log"
(while sleep 1; do curl -sf --max-time 2 "$HEALTH" >/dev/null || date +%T >>"$OUT/not_ready.log"; done) &
POLL_PID=$!
for rate in $RATES; do
  echo "=== locust over gRPC, open loop, $rate requests/s, $WORKLOAD workload, $DURATION"
  "$PY" -m loadtest --api triton --rate "$rate" --workload "$WORKLOAD" --duration "$DURATION" \
      --results-dir "$OUT/rate_$rate" ${LOADTEST_ARGS:-} | tail -12
  ((PIPESTATUS[0] == 0)) || fail "errors at rate $rate"
done
kill "$POLL_PID"
wait "$POLL_PID" 2>/dev/null
polls=$(wc -l <"$OUT/not_ready.log")
((polls == 0)) || fail "not ready at $polls polls under the load (times in $OUT/not_ready.log)"

drained=""
for _ in $(seq 60); do  # in-flight requests finish and the gauges refresh
  drained=$(gauges | awk '/^neo_(requests|kv_blocks_used)/ && $NF != 0 {busy=1} END {print busy ? "" : "yes"}')
  [[ -n "$drained" ]] && break
  sleep 1
done
echo "=== gauges after the load"; gauges | tee "$OUT/metrics_after.txt"
[[ -n "$drained" ]] || fail "requests or KV blocks still in use after the load"

echo "=== SIGTERM"
start=$SECONDS
kill -TERM "$SERVE_PID"
wait "$SERVE_PID"
rc=$?
echo "stopped in $((SECONDS - start))s, exit status $rc"
((SECONDS - start <= 15)) || fail "shutdown took longer than 15 s"
((rc == 0)) || fail "exit status $rc"
if grep -n -E "terminate called|Segmentation fault|core dumped|Traceback" "$OUT/serve.log"; then fail "the log shows a crash"; fi
pgrep -f "tritonserver|triton_python_backend_stub" && fail "processes left behind"

if [[ "${COMPARE:-0}" == 1 ]]; then
  echo "=== in-process bench/serving.py replaying the load each rate sent"
  flags=$("$PY" - <<'PY'
# the served engine's knobs (config.pbtxt, then NEO_*) as bench/serving.py's flags; its policy comes separately
from neo_backend.config import EngineConfig
from neo_backend.triton.server import DEFAULT_MODEL_REPOSITORY, MODEL_NAME, read_parameters
served = EngineConfig.from_env(base=EngineConfig.from_strings(read_parameters(DEFAULT_MODEL_REPOSITORY / MODEL_NAME / "config.pbtxt")))
flags = []
for name, value in served.changed_knobs().items():
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        flags.append(flag if value else "--no-" + flag[2:])
    elif name != "offload_policy" and value is not None:
        flags += [flag, str(value)]
print(" ".join(flags))
PY
)
  records=()
  for rate in $RATES; do records+=("$OUT/rate_$rate/requests.jsonl"); done
  # shellcheck disable=SC2086
  "$PY" bench/serving.py --replay-records "${records[@]}" --policies "${NEO_OFFLOAD_POLICY:-auto}" $flags \
      --json "$OUT/serving.json" 2>&1 | grep -v "INFO\|WARNING" | tail -6
  ((PIPESTATUS[0] == 0)) || fail "bench/serving.py failed"
  "$PY" - "$OUT" $RATES <<'PY' || fail "no comparison"
import json, sys
from pathlib import Path
out, rates = Path(sys.argv[1]), sys.argv[2:]
rows = next(iter(json.loads((out / "serving.json").read_text())["results"].values()))
for rate, row in zip(rates, rows):
    stack = json.loads((out / f"rate_{rate}" / "summary.json").read_text())["output_tokens_per_s"]
    inproc = row["output_tokens_per_s"]
    print(f"rate {rate}: output tokens/s through Triton {stack:.1f}, in-process {inproc:.1f}, ratio {stack / inproc:.3f}")
PY
fi
exit $status
