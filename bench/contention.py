"""CPU-contention benchmark: the `auto` policy's fail-safe against real CPU hogs, next to `always` (and `never`).

For each policy, a steady Poisson load (serving.py's trace and replay) runs through four windows: a warm-up
(not reported), `quiet`, `contention` (one process per core copies a buffer larger than the LLC in a loop, taking
CPU time and memory bandwidth; or, `--hog-kind compute`, only CPU time) and `recovery` (hogs killed). `auto`
should notice the slow CPU work, stop offloading and keep its P99 TPOT; `always` cannot, and degrades. With
`--engine-cpu` the hogs run on every core but that one, as where an operator keeps other workloads off the
engine's CPU (cpusets); without it they share every core, the engine loop's too.

    python bench/contention.py --gpu-memory-gb 24 --rate 6 --cpu-kv-cache-gb 32 --policies auto always never \\
        --warmup-seconds 8 --phase-seconds 12 --json contention.json
    # CPU smoke test on a small model:
    python bench/contention.py --device cpu --model <tiny hf dir> --num-gpu-blocks 24 --block-size 8 \\
        --max-num-batched-tokens 64 --cpu-kv-cache-gb 0.01 --workload fixed --fixed 64 128 --rate 8 \\
        --warmup-seconds 3 --phase-seconds 6 --hogs 2

Tokens are assigned to a window by the time the client received them. Per policy and window: output tokens/s;
TPOT P50/P99 over the requests with at least MIN_GAPS inter-token gaps ending in the window (each one's TPOT
there is the mean of those gaps); P99 TTFT of the requests that arrived in it; and, from the engine's stats
sampled every SAMPLE_INTERVAL_S, the share of tokens decoded on the CPU, preemptions and swaps, the fail-safe's
signals (cpu_correction, offload_slowdown) and the fraction of samples in which the scheduler was `cpu_behind`.
The last line: `<policy>_p99_tpot_ratio=<P99 TPOT contention / quiet>` per policy.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import (  # noqa: E402
    Record,
    add_engine_args,
    make_trace,
    pct,
    replay,
    start_engine,
    trace_vocab,
    without_last_iteration,  # noqa: E402
)

from neo_backend.core.scheduler import CPU_BEHIND  # noqa: E402
from neo_backend.cpu.affinity import attention_cpus  # noqa: E402
from neo_backend.streaming import StreamingEngine  # noqa: E402

PHASES = ("quiet", "contention", "recovery")
HOG_BUFFER_MIB = 64  # per memory hog, source and destination each: together well beyond any LLC


def _hog_code(setup: str, work: str) -> str:
    """A hog's program. argv: the benchmark's pid (a hog ends by itself should the benchmark be killed), its CPUs."""
    return f"""
import os, sys
os.sched_setaffinity(0, {{int(cpu) for cpu in sys.argv[2].split(",")}})
{setup}
while os.getppid() == int(sys.argv[1]):
    {work}
"""


HOG_CODE = {
    "memory": _hog_code(
        f"import numpy as np\nsrc = np.ones({HOG_BUFFER_MIB} << 17)\ndst = np.empty_like(src)", "np.copyto(dst, src)"
    ),
    "compute": _hog_code("", "sum(range(100_000))"),
}
SAMPLE_INTERVAL_S = 0.5
MIN_GAPS = 4  # a request with fewer inter-token gaps in a window gives no TPOT sample there
COUNTERS = ("generation_tokens", "cpu_decode_tokens", "preemptions", "swap_out_blocks", "swap_in_blocks")

Window = tuple[float, float]


def start_hogs(kind: str, count: int, cpus: set[int]) -> list[subprocess.Popen]:
    where = ",".join(map(str, sorted(cpus)))
    return [subprocess.Popen([sys.executable, "-c", HOG_CODE[kind], str(os.getpid()), where]) for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def hog_window(
    kind: str,
    count: int,
    cpus: set[int],
    start_at: float,
    stop_at: float,
    marks: dict[str, float],
    cancel: threading.Event,
) -> None:
    """Hogs from `start_at` to `stop_at` (or until cancelled); `marks` gets when they really started and ended."""
    if cancel.wait(max(0.0, start_at - time.perf_counter())):
        return
    hogs = start_hogs(kind, count, cpus)
    marks["contention"] = time.perf_counter()
    try:
        cancel.wait(max(0.0, stop_at - time.perf_counter()))
    finally:
        stop_hogs(hogs)
        marks["recovery"] = time.perf_counter()


def sample_stats(front: StreamingEngine, samples: list[tuple[float, dict]], cancel: threading.Event) -> None:
    while not cancel.wait(SAMPLE_INTERVAL_S):
        samples.append((time.perf_counter(), front.stats()))


def drive(
    front: StreamingEngine, trace, args: argparse.Namespace
) -> tuple[dict[str, Window], list[Record], list[tuple[float, dict]]]:
    """Replay `trace` with hogs during the contention window; (windows, records, stats samples)."""
    cancel, marks, samples = threading.Event(), {}, []
    quiet_at = time.perf_counter() + args.warmup_seconds
    end = quiet_at + 3 * args.phase_seconds
    cpus = attention_cpus(front.config.engine_cpu)
    hogs = len(cpus) if args.hogs is None else args.hogs
    helpers = [
        threading.Thread(
            target=hog_window,
            args=(
                args.hog_kind,
                hogs,
                cpus,
                quiet_at + args.phase_seconds,
                quiet_at + 2 * args.phase_seconds,
                marks,
                cancel,
            ),
        ),
        threading.Thread(target=sample_stats, args=(front, samples, cancel)),
    ]
    for thread in helpers:
        thread.start()
    try:
        records = replay(front, trace, timeout_s=0)
        time.sleep(max(0.0, end - time.perf_counter()))
    finally:
        cancel.set()
        for thread in helpers:
            thread.join()
    windows = {
        "quiet": (quiet_at, marks["contention"]),
        "contention": (marks["contention"], marks["recovery"]),
        "recovery": (marks["recovery"], end),
    }
    return windows, records, samples


def request_figures(records: list[Record], window: Window) -> dict:
    lo, hi = window
    tpot, tokens = [], 0
    for rec in records:
        tokens += sum(lo <= t < hi for t in rec.token_times)
        gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:]) if lo <= b < hi]
        if len(gaps) >= MIN_GAPS:
            tpot.append(statistics.mean(gaps))
    ttft = [r.first - r.start for r in records if r.first and lo <= r.start < hi]
    return {
        "seconds": hi - lo,
        "requests": len(tpot),
        "output_tokens_per_s": tokens / (hi - lo),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "ttft_p99_s": pct(ttft, 99),
    }


def engine_figures(samples: list[tuple[float, dict]], window: Window) -> dict:
    inside = [stats for t, stats in samples if window[0] <= t < window[1]]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    delta = {key: last[key] - first[key] for key in COUNTERS}
    correction = [s["cpu_correction"] or 1.0 for s in inside]
    slowdown = [s["offload_slowdown"] or 1.0 for s in inside]
    behind = sum(max(c, s) > CPU_BEHIND for c, s in zip(correction, slowdown))
    return {
        "cpu_decode_share": delta["cpu_decode_tokens"] / max(1, delta["generation_tokens"]),
        **delta,
        "mean_cpu_requests": statistics.mean(s["requests_cpu_decode"] for s in inside),
        "max_cpu_correction": max(correction),
        "max_offload_slowdown": max(slowdown),
        "cpu_behind_fraction": behind / len(inside),
        "stats_at_end": without_last_iteration(last),
    }


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    front = start_engine(args, policy)
    total = args.warmup_seconds + 3 * args.phase_seconds
    trace = [
        t
        for t in make_trace(
            math.ceil(1.5 * args.rate * total) + 10,
            args.rate,
            args.workload,
            trace_vocab(front),
            args.seed,
            tuple(args.fixed),
        )
        if t[0] < total
    ]
    try:
        windows, records, samples = drive(front, trace, args)
    finally:
        front.shutdown()
    phases = {
        name: {**request_figures(records, windows[name]), **engine_figures(samples, windows[name])} for name in PHASES
    }
    return {"num_gpu_blocks": front.engine.gpu_blocks.num_blocks, "requests_sent": len(trace), "phases": phases}


def ratio(result: dict, phase: str) -> float:
    base, other = result["phases"]["quiet"]["tpot_p99_s"], result["phases"][phase]["tpot_p99_s"]
    return other / base if base and other is not None else float("nan")


def print_policy(policy: str, result: dict) -> None:
    for name in PHASES:
        p = result["phases"][name]
        print(
            f"{policy:7s} {name:10s}: {p['requests']:4d} req {p['output_tokens_per_s']:7.1f} tok/s  "
            f"TPOT p50 {p['tpot_p50_s']} p99 {p['tpot_p99_s']}  TTFT p99 {p['ttft_p99_s']}  "
            f"cpu share {p.get('cpu_decode_share', float('nan')):.3f}  "
            f"behind {p.get('cpu_behind_fraction', float('nan')):.2f}  "
            f"max cpu_correction {p.get('max_cpu_correction')} offload_slowdown {p.get('max_offload_slowdown')}  "
            f"preemptions {p.get('preemptions')}",
            flush=True,
        )
    print(
        f"{policy:7s} P99 TPOT contention/quiet {ratio(result, 'contention'):.3f}  "
        f"recovery/quiet {ratio(result, 'recovery'):.3f}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=["auto", "always", "never"])
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s of the Poisson load")
    parser.add_argument("--phase-seconds", type=float, default=40.0, help="length of quiet, contention, recovery")
    parser.add_argument("--warmup-seconds", type=float, default=10.0, help="load before the quiet window")
    parser.add_argument(
        "--hog-kind",
        choices=list(HOG_CODE),
        default="memory",
        help="memory: copy buffers beyond the LLC (CPU time and memory bandwidth); compute: CPU time",
    )
    parser.add_argument("--hogs", type=int, help="busy processes (default: one per core they may use)")
    parser.add_argument("--workload", choices=["a10g", "fixed"], default="a10g")
    parser.add_argument("--fixed", nargs=2, type=int, default=[256, 128], metavar=("INPUT", "OUTPUT"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    add_engine_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results, ratios = {}, {}
    for policy in args.policies:
        results[policy] = run_policy(args, policy)
        ratios[policy] = ratio(results[policy], "contention")
        print_policy(policy, results[policy])
        if args.json:  # after each policy, so that a run cut short still leaves what it measured
            args.json.write_text(
                json.dumps(
                    {"p99_tpot_ratio": ratios, "results": results, "args": {k: str(v) for k, v in vars(args).items()}},
                    indent=1,
                    default=str,
                )
            )
    print(" ".join(f"{p}_p99_tpot_ratio={r:.3f}" for p, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
