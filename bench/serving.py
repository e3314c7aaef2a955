"""Serving benchmark: a seeded trace with Poisson arrivals replayed in-process against the streaming front,
swept over request rates, for several offload policies on one engine (same weights, graphs and profile; the
policy changes between runs), the same traces and knobs.

    python bench/serving.py --gpu-memory-gb 24 --rates 1 2 4 6 8 --policies never auto always
    python bench/serving.py --gpu-memory-gb 24 --gpu-sm-count 8 --rates 0.5 1 2 --offline 100   # A10G-class
    python bench/serving.py --replay-records results/rate_1/requests.jsonl   # the load a `python -m loadtest` run sent
    python bench/serving.py --merge light.json rate04.json --json sweep.json   # a sweep split over several runs

Per rate: requests/s, output tokens/s, mean per-token latency (the NEO paper's metric: mean over requests of
(end - start) / output tokens), P50/P99 TTFT and TPOT, the mean decode batch on the GPU and on the CPU; requests
arriving in the first --warmup-seconds load the server but are left out of the figures. Per policy, two
comparisons with GPU-only (`never`): the paper's, the highest output tokens/s whose mean per-token latency
stays under 2x GPU-only's at the lightest rate; and the highest whose P99 TPOT stays under the SLO (default
1.5x GPU-only's P99 TPOT at the lightest rate). --offline adds a run with every request at t=0 (alone with
`--rates` given no values). --merge builds one report from the reports of several runs of one setting, so that a
sweep whose traces are too long for one run (steady state at saturated rates) can be split by rate.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LLAMA3_8B  # noqa: E402

from loadtest.records import read_records  # noqa: E402
from neo_backend import EngineConfig  # noqa: E402
from neo_backend.streaming import StreamingEngine  # noqa: E402

ACTIVATION_RESERVE_GB = 2.0


@dataclass
class Record:
    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter() at which each output token arrived


def make_trace(
    num: int, rate: float, workload: str, vocab: int, seed: int, fixed: tuple[int, int] = (256, 128)
) -> list[tuple[float, list[int], int]]:
    """(arrival offset, prompt ids, output tokens): the NEO paper's A10G workload is input 1000, outputs
    uniform 50..400 then +-10%; `fixed` is (input, output) tokens."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        if workload == "a10g":
            prompt_len, out = 1000, int(rng.uniform(50, 400) * rng.uniform(0.9, 1.1))
        else:
            prompt_len, out = fixed
        trace.append((t, [rng.randrange(vocab) for _ in range(prompt_len)], out))
    return trace


def trace_from_records(path: Path, vocab: int, seed: int = 0) -> list[tuple[float, list[int], int]]:
    """The load one `python -m loadtest` run sent, from its requests.jsonl: each request's arrival offset, its
    prompt length as the server counted it (random ids) and the output tokens it received."""
    rng = random.Random(seed)
    records = sorted((r for r in read_records(path) if r.input_tokens), key=lambda r: r.start)
    if not records:
        raise SystemExit(f"{path}: no request with a server-counted prompt length to replay")
    t0 = records[0].start
    return [(r.start - t0, [rng.randrange(vocab) for _ in range(r.input_tokens)], r.output_tokens) for r in records]


def arrival_rate(trace: list[tuple[float, list[int], int]]) -> float:
    return (len(trace) - 1) / trace[-1][0] if len(trace) > 1 and trace[-1][0] > 0 else float("inf")


def replay(front: StreamingEngine, trace, timeout_s: float) -> list[Record]:
    records = [Record(0.0) for _ in trace]
    threads = []
    t0 = time.perf_counter()

    def consume(i: int, prompt: list[int], out_len: int) -> None:
        rec = records[i]
        rec.start = time.perf_counter()
        try:
            stream = front.submit(prompt, {"max_tokens": out_len, "temperature": 0, "ignore_eos": True})
            for out in stream:
                now = time.perf_counter()
                if out.token_ids and rec.first is None:
                    rec.first = now
                rec.tokens += len(out.token_ids)
                rec.token_times += [now] * len(out.token_ids)
                if out.error:
                    rec.error = out.error
        except Exception as exc:  # recorded, counted as a failure in the report
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.end = time.perf_counter()

    for i, (offset, prompt, out_len) in enumerate(trace):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        # not a daemon: one still streaming when the replay returns ends when the engine's shutdown fails its
        # stream; a daemon thread cut off at interpreter exit aborted the process (`terminate called ...`)
        th = threading.Thread(target=consume, args=(i, prompt, out_len))
        th.start()
        threads.append(th)
    deadline = time.perf_counter() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    return records


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


class IterationLog:
    """Samples the engine's stats after each iteration (the loop thread publishes a fresh snapshot per step) into
    JSON lines: mode, rows, predicted and measured time, the performance model's corrections, queues, swaps."""

    def __init__(self, front: StreamingEngine, path: Path | None) -> None:
        self.front, self.file = front, path.open("w") if path else None
        self.label, self._stop, self._thread = "", threading.Event(), None

    def start(self, label: str) -> None:
        if self.file is None:
            return
        self.label, self._stop = label, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.file.flush()

    def _sample(self) -> None:
        last, t0 = None, time.perf_counter()
        while not self._stop.wait(0.002):
            stats = self.front.stats()
            if stats["last_iteration"] is last:
                continue
            last = stats["last_iteration"]
            keys = (
                "requests_waiting",
                "requests_gpu_decode",
                "requests_cpu_decode",
                "gpu_blocks_used",
                "swap_out_blocks",
                "swap_in_blocks",
                "preemptions",
                "preemptions_by_cause",
                "cpu_correction",
                "offload_slowdown",
            )
            row = {"run": self.label, "t": round(time.perf_counter() - t0, 4), **last, **{k: stats[k] for k in keys}}
            self.file.write(json.dumps(row) + "\n")


def decode_batches(before: dict, after: dict) -> dict:
    """Mean decode rows per iteration on each side between two engine stats snapshots."""
    iterations = sum(after["modes"].values()) - sum(before["modes"].values())
    return {
        f"mean_{side}_decode_batch": (after[f"{side}_decode_tokens"] - before[f"{side}_decode_tokens"])
        / max(iterations, 1)
        for side in ("gpu", "cpu")
    }


def rate_label(rate: float) -> str:
    """How a rate's run is named in the printout and in the iteration log (after its policy)."""
    return f"rate {rate:6.2f}"


def summarize(records: list[Record]) -> dict:
    done = [r for r in records if r.end and not r.error and r.tokens]
    span = max(r.end for r in done) - min(r.start for r in done) if done else float("nan")
    ttft = [r.first - r.start for r in done if r.first]
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in done if r.first and r.tokens > 1]
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "requests_per_s": len(done) / span,
        "output_tokens_per_s": sum(r.tokens for r in done) / span,
        "mean_per_token_latency_s": statistics.mean((r.end - r.start) / r.tokens for r in done) if done else None,
        # the part of it spent after the first token: the rest is the wait for it (queue and prefill)
        "mean_per_token_decode_s": statistics.mean((r.end - r.first) / r.tokens for r in done) if done else None,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
    }


def kv_blocks_for(gpu_memory_gb: float, config: EngineConfig) -> int:
    """KV blocks an emulated GPU of `gpu_memory_gb` has left after bf16 weights and an activation reserve; under
    tensor parallelism, each GPU's: its shard of the weights, its share of the KV heads."""
    from neo_backend.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((Path(config.model) / "config.json").read_text()))
    params = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    tp = config.tensor_parallel_size
    block_bytes = 2 * cfg.num_layers * config.block_size * cfg.num_kv_heads // tp * cfg.head_dim * 2
    free = gpu_memory_gb * 2**30 - 2 * params / tp - ACTIVATION_RESERVE_GB * 2**30
    return max(1, int(free // block_bytes))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's knobs plus --gpu-memory-gb; without --model the benchmarks run the dummy Llama-3-8B shape."""
    parser.add_argument("--gpu-memory-gb", type=float, help="emulate a GPU of this size (sets num_gpu_blocks)")
    EngineConfig.add_cli_args(parser)


def start_engine(args: argparse.Namespace, policy: str) -> StreamingEngine:
    """An engine for `policy`; one built for `auto` serves every policy (`LLMEngine.set_offload_policy`)."""
    if args.model is None:
        args.model, args.load_format = LLAMA3_8B, "dummy"
    args.offload_policy = policy
    config = EngineConfig.from_cli_args(args)
    if args.gpu_memory_gb:
        config.num_gpu_blocks = kv_blocks_for(args.gpu_memory_gb, config)
    return StreamingEngine(config)


def trace_length(rate: float, seconds_per_rate: float | None, num_requests: int) -> int:
    return max(8, math.ceil(rate * seconds_per_rate)) if seconds_per_rate else num_requests


def rate_trace(rate: float, args: argparse.Namespace, vocab: int) -> list[tuple[float, list[int], int]]:
    num = trace_length(rate, args.seconds_per_rate, args.num_requests)
    return make_trace(num, rate, args.workload, vocab, int(rate * 1000), tuple(args.fixed))


def trace_vocab(front: StreamingEngine) -> int:
    """Token ids a trace may use: in both the model's vocabulary and the tokenizer's."""
    return min(front.engine.model_config.vocab_size, len(front.engine.tokenizer))


def without_last_iteration(stats: dict) -> dict:
    """An engine stats snapshot, less the last iteration's details."""
    return {k: v for k, v in stats.items() if k != "last_iteration"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=["never", "auto"])
    parser.add_argument("--rates", nargs="*", type=float, default=[1, 2, 4, 8], help="none: only the --offline run")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument(
        "--seconds-per-rate",
        type=float,
        help="instead of --num-requests: rate x this many requests per rate (at least 8)",
    )
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=0.0,
        help="requests arriving this early in a trace load the server but are left out of its figures",
    )
    parser.add_argument(
        "--offline", type=int, default=0, metavar="N", help="also an offline run per policy: N requests, all at t=0"
    )
    parser.add_argument("--workload", choices=["a10g", "fixed"], default="a10g")
    parser.add_argument(
        "--replay-records",
        nargs="+",
        type=Path,
        metavar="JSONL",
        help="instead of --rates: replay the load of these load-test runs (their requests.jsonl), one run each",
    )
    parser.add_argument("--fixed", nargs=2, type=int, default=[256, 128], metavar=("INPUT", "OUTPUT"))
    parser.add_argument("--slo-factor", type=float, default=1.5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--iteration-log", type=Path, help="JSON lines of every iteration's engine stats")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="run nothing: one report (--json) from these reports of one setting, each rate measured once",
    )
    add_engine_args(parser)
    args = parser.parse_args()
    if args.merge:
        report = merge_reports(args.merge, args.slo_factor)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: report.get(k) for k in SUMMARY_KEYS}))
        return 0
    if not (args.rates or args.offline or args.replay_records):
        parser.error("nothing to run: give --rates, --offline or --replay-records")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    front = start_engine(args, "never" if set(args.policies) == {"never"} else "auto")
    iteration_log = IterationLog(front, args.iteration_log)
    if front.engine.perf_model is not None:
        print(f"performance model: {front.engine.perf_model}", flush=True)
    num_gpu_blocks, vocab = front.engine.gpu_blocks.num_blocks, trace_vocab(front)
    results: dict[str, list[dict]] = {}
    offline: dict[str, dict] = {}
    report: dict = {}

    def save() -> None:
        """The report so far, written after every run so a benchmark cut short keeps what it measured."""
        nonlocal report
        given = {k: str(v) for k, v in vars(args).items()}
        report = build_report(results, offline, args.slo_factor, num_gpu_blocks, given)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))

    def run(policy: str, label: str, trace) -> dict:
        before = front.engine.stats_snapshot()
        iteration_log.start(f"{policy} {label.strip()}")
        records = replay(front, trace, args.timeout)
        iteration_log.stop()
        after = front.engine.stats_snapshot()
        measured = [r for r, (offset, _, _) in zip(records, trace) if offset >= args.warmup_seconds] or records
        row = {**summarize(measured), **decode_batches(before, after), "stats": without_last_iteration(after)}
        print(
            f"{policy:7s} {label}: {row['requests_per_s']:.2f} req/s {row['output_tokens_per_s']:.0f} tok/s  "
            f"per-token {row['mean_per_token_latency_s']}  TPOT p99 {row['tpot_p99_s']}  TTFT p50 "
            f"{row['ttft_p50_s']} p99 {row['ttft_p99_s']}  decode batch gpu {row['mean_gpu_decode_batch']:.1f} "
            f"cpu {row['mean_cpu_decode_batch']:.1f}  failed {row['failed']}",
            flush=True,
        )
        return row

    traces = (
        [(arrival_rate(t), t) for t in (trace_from_records(path, vocab) for path in args.replay_records)]
        if args.replay_records
        else [(rate, rate_trace(rate, args, vocab)) for rate in args.rates]
    )
    for policy in args.policies:
        front.engine.set_offload_policy(policy)
        # warm-up, not reported: first-call compiles and allocations would otherwise land in the SLO's baseline
        replay(front, make_trace(8, 100.0, args.workload, vocab, 7, tuple(args.fixed)), args.timeout)
        results[policy] = []
        for rate, trace in traces:
            results[policy].append({"rate": rate, **run(policy, rate_label(rate), trace)})
            save()
        if args.offline:
            trace = make_trace(args.offline, float("inf"), args.workload, vocab, 1, tuple(args.fixed))
            offline[policy] = run(policy, "offline   ", trace)
            save()
    front.shutdown()
    print(json.dumps({k: report.get(k) for k in SUMMARY_KEYS}))
    return 0


SUMMARY_KEYS = (
    "paper_metric",
    "slo_tpot_p99_s",
    "best_throughput_under_slo",
    "ratios_over_never",
    "offline_ratios_over_never",
)


def paper_metric(results: dict[str, list[dict]], factor: float = 2.0) -> dict:
    """The NEO paper's comparison: per policy, the highest output tokens/s among the rates whose mean per-token
    latency stays under `factor` times GPU-only's at the lightest rate; and the ratios over GPU-only."""
    base = results.get("never") or next(iter(results.values()))
    bound = factor * min(base, key=lambda r: r["rate"])["mean_per_token_latency_s"]
    best = {
        policy: max(
            (
                r["output_tokens_per_s"]
                for r in rows
                if not r["failed"]
                and r["mean_per_token_latency_s"] is not None
                and r["mean_per_token_latency_s"] <= bound
            ),
            default=0.0,
        )
        for policy, rows in results.items()
    }
    metric = {"latency_bound_s": bound, "best_throughput_under_latency": best}
    if best.get("never"):
        metric["ratios_over_never"] = {p: b / best["never"] for p, b in best.items()}
    return metric


def build_report(
    results: dict[str, list[dict]], offline: dict[str, dict], slo_factor: float, num_gpu_blocks: int | None, args
) -> dict:
    """The paper's metric; per policy, the best output tokens/s among rates whose P99 TPOT meets the SLO (its base
    the first rate's), and ratios over never; the offline runs and their throughput ratios. `args`: what the
    run(s) were given, recorded as is."""
    report: dict = {}
    if any(results.values()):
        base = results.get("never") or next(iter(results.values()))
        slo = slo_factor * base[0]["tpot_p99_s"]
        best = {}
        for policy, rows in results.items():
            ok = [r for r in rows if r["tpot_p99_s"] is not None and r["tpot_p99_s"] <= slo and not r["failed"]]
            best[policy] = max((r["output_tokens_per_s"] for r in ok), default=0.0)
        report.update(paper_metric=paper_metric(results), slo_tpot_p99_s=slo, best_throughput_under_slo=best)
        if best.get("never"):
            report["ratios_over_never"] = {p: b / best["never"] for p, b in best.items()}
    report.update(results=results, offline=offline, num_gpu_blocks=num_gpu_blocks, args=args)
    if "never" in offline:
        report["offline_ratios_over_never"] = {
            p: r["output_tokens_per_s"] / offline["never"]["output_tokens_per_s"] for p, r in offline.items()
        }
    return report


def merge_reports(paths: list[Path], slo_factor: float) -> dict:
    """One report from several of this script's reports of one setting (a sweep split by rate over runs): each
    policy's rate rows in rate order, the offline runs, and the comparisons over them all."""
    results: dict[str, list[dict]] = {}
    offline: dict[str, dict] = {}
    args, pools = [], set()
    for path in paths:
        part = json.loads(path.read_text())
        for policy, rows in part["results"].items():
            results.setdefault(policy, []).extend(rows)
        for policy, row in part["offline"].items():
            if policy in offline:
                raise SystemExit(f"{path}: a second offline run of {policy}")
            offline[policy] = row
        args.append(part["args"])
        pools.add(part["num_gpu_blocks"])
    if len(pools) > 1:
        raise SystemExit(f"the reports have device pools of {sorted(pools)} blocks: not one setting")
    for policy, rows in results.items():
        rates = [r["rate"] for r in rows]
        if len(set(rates)) < len(rates):
            raise SystemExit(f"{policy} was measured more than once at one rate: {sorted(rates)}")
        rows.sort(key=lambda r: r["rate"])
    return build_report(results, offline, slo_factor, pools.pop(), args)


if __name__ == "__main__":
    sys.exit(main())
