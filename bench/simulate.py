"""The real scheduler on a simulated clock: what each offload policy serves on a roofline-shaped GPU and host.

    python bench/simulate.py --setting a10g --rates 0.5 1 1.5 2 2.5 3 --policies never auto always

Each iteration the engine's `Scheduler` plans as in serving; the iteration then takes the time the cost model
gives for its mode (GPU-only, sequential or pipelined, the same formulas as `PerfModel`, a pipelined step's
hand-offs beyond them) plus its planned swaps at the rate the engine lands them, and every scheduled request
advances; the swap-outs started after a step (which overlap the device's work) land by the next. The scheduler's
model observes each step as the engine's does, so it learns what its formulas miss. The cost model is built
from a device's bandwidth and matrix rate and the host's attention bandwidth and hand-off cost (`Roofline`),
fitted to a machine's 8-SM partition and 16-core host as measured (`Fit`: `--fit h200`, the default, or `--fit
h100`; bench/RESULTS.md). `--iteration-log FILE` writes each iteration as `bench/serving.py --iteration-log`
does, for `bench/iterations.py` to set beside a measured run. A design tool for the policy, run in seconds on a
laptop; it says nothing about the engine's own overheads beyond the fitted terms, which only `bench/serving.py`
on the GPU measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import Record, make_trace, paper_metric, rate_label, summarize, trace_length  # noqa: E402

from neo_backend import EngineConfig, SamplingParams  # noqa: E402
from neo_backend.core.block_manager import BlockManager  # noqa: E402
from neo_backend.core.perf_model import PerfModel  # noqa: E402
from neo_backend.core.scheduler import Scheduler  # noqa: E402
from neo_backend.core.scheduler_output import SchedulerOutput  # noqa: E402
from neo_backend.core.sequence import Sequence  # noqa: E402
from neo_backend.executor.profiler import DENSE_PROFILE_TOKENS  # noqa: E402

BLOCK_SIZE = 16
SWAP_BYTES_PER_S = 46e9  # a swap as the step waits for it on the device: the copy between the pinned host
# pool and the device, 12-14 ms per 579 MB request (bench/swap.py, setting (e)'s shape)


@dataclass
class Roofline:
    """Iteration costs of a dense decoder on a device of `gpu_bw` bytes/s and `gpu_flops`, beside a host whose
    attention reads `cpu_bw` bytes/s."""

    weight_bytes: float
    kv_bytes_per_token: float
    gpu_bw: float
    gpu_flops: float
    cpu_bw: float
    cpu_fixed_s: float
    cpu_per_request_s: float = 20e-6
    step_overhead_s: float = 1e-3
    pipelined_extra_s: float = 0.0  # what a pipelined iteration costs beyond the model's formula (its hand-offs)

    def dense(self, tokens: int) -> float:
        flops = 2 * self.weight_bytes / 2 * tokens  # bf16: params = bytes / 2, 2 FLOPs per param and token
        return max(self.weight_bytes / self.gpu_bw, flops / self.gpu_flops) + self.step_overhead_s

    def perf_model(self) -> PerfModel:
        points = [*DENSE_PROFILE_TOKENS, 2048]  # what the profiler measures at the default token budget
        return PerfModel(
            points,
            [self.dense(t) for t in points],
            self.kv_bytes_per_token / self.gpu_bw,
            self.cpu_fixed_s,
            self.cpu_per_request_s,
            self.kv_bytes_per_token / self.cpu_bw,
        )


@dataclass(frozen=True)
class Fit:
    """A machine's terms at 8 SMs, fitted to serving's iteration log in setting (e) (Llama-2-7B shape,
    bench/RESULTS.md): the bytes/s the engine's decodes read (where a copy, reading and writing, moves ~640 GB/s),
    the host attention's read rate and what an iteration with host work costs beyond it (the layers' hand-offs,
    the device's attention running beside the host's), and what a pipelined iteration costs beyond the model's
    formula."""

    gpu_bw: float
    host_bw: float
    host_fixed_s: float
    pipelined_extra_s: float


FITS = {
    # one decode 16.9 ms; 2 GPU + 1 / 2 / 3 CPU decodes (context ~1.2k) 25.7 / 30.1 / 37.0 ms against 18.3;
    # pipelined 2 + 4 / 5 / 6 / 7 40.1 / 40.1 / 41.6 / 45.7 ms
    "h200": Fit(gpu_bw=850e9, host_bw=128e9, host_fixed_s=3.6e-3, pipelined_extra_s=5.0e-3),
    # one decode 20.0 ms; 2 GPU + 1 / 2 / 3 CPU decodes 29.8 / 34.9 / 40.0 ms against 21.4; pipelined 46-47 ms
    "h100": Fit(gpu_bw=710e9, host_bw=123e9, host_fixed_s=4.2e-3, pipelined_extra_s=4.5e-3),
}


def setting(name: str, fit: Fit, gpu_flops: float = 55e12) -> tuple[Roofline, int, float]:
    """(cost model, device KV blocks, host KV GiB) of the emulated settings on a machine's fit."""
    terms = dict(
        gpu_bw=fit.gpu_bw,
        gpu_flops=gpu_flops,
        cpu_bw=fit.host_bw,
        cpu_fixed_s=fit.host_fixed_s,
        pipelined_extra_s=fit.pipelined_extra_s,
    )
    if name == "a10g":  # Llama-3-8B (GQA 8 KV heads), 24 GB: 3606 blocks as bench/serving.py sizes it
        return Roofline(16.06e9, 2 * 32 * 8 * 128 * 2, **terms), 3606, 32.0
    if name == "t4mem":  # Llama-2-7B (MHA), 16 GB
        return Roofline(13.5e9, 2 * 32 * 32 * 128 * 2, **terms), 185, 48.0
    raise ValueError(name)


def iteration_time(roof: Roofline, perf: PerfModel, out: SchedulerOutput) -> float:
    """The step's time on the simulated clock: the cost model's, a pipelined step's hand-offs beyond it."""
    cpu = [len(s.token_ids) for s in out.cpu_decodes]
    step = perf.iteration(*out.gpu_work(), cpu, out.split if out.pipelined else None)
    return step + (roof.pipelined_extra_s if out.pipelined else 0.0)


def log_row(sched: Scheduler, out: SchedulerOutput, clock: float, step: float, swap_s: float) -> dict:
    """One iteration as `bench/serving.py --iteration-log` records it (the keys `bench/iterations.py` reads), so a
    simulated run and a measured one compare kind by kind. The host's attention takes what the model predicts."""
    return {
        "t": round(clock, 4),
        "mode": out.mode,
        "prefill_tokens": sum(n for _, n in out.prefills),
        "gpu_decodes": len(out.gpu_decodes),
        "cpu_decodes": len(out.cpu_decodes),
        "split": out.split if out.pipelined else None,
        "predicted_s": round(out.predicted_time, 6),
        "measured_s": round(step, 6),
        "predicted_cpu_s": round(out.predicted_cpu_time, 6),
        "measured_cpu_s": round(out.predicted_cpu_time, 6),
        "schedule_s": round(swap_s, 6),
        "swap_s": round(swap_s, 6),
        "requests_waiting": len(sched.waiting),
        "requests_gpu_decode": len(sched.running),
        "requests_cpu_decode": len(sched.cpu_running),
        "preemptions_by_cause": dict(sched.preemptions),
        "cpu_correction": round(sched.perf.cpu_correction, 3),
        "offload_slowdown": round(sched.perf.offload_slowdown, 3),
    }


def simulate(
    policy: str, roof: Roofline, gpu_blocks: int, cpu_gb: float, trace, knobs: dict, log: list[dict] | None = None
) -> tuple[list, dict]:
    """(records, stats) of one policy over `trace`; each iteration's row appended to `log`, where given, as the
    engine's iteration log has it (`log_row`)."""
    config = EngineConfig(offload_policy=policy, block_size=BLOCK_SIZE, **knobs)
    block_bytes = roof.kv_bytes_per_token * BLOCK_SIZE
    cpu_blocks = int(cpu_gb * 2**30 // block_bytes) if policy != "never" else 0
    perf = roof.perf_model()
    gpu_pool, cpu_pool = BlockManager(gpu_blocks, BLOCK_SIZE, "gpu"), BlockManager(cpu_blocks, BLOCK_SIZE, "cpu")
    sched = Scheduler(config, policy, gpu_pool, cpu_pool, perf)
    records = [Record(offset) for offset, _, _ in trace]
    seqs = [
        Sequence(f"r{i}", None, prompt, SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=offset)
        for i, (offset, prompt, out) in enumerate(trace)
    ]
    clock, next_arrival, live, in_flight = 0.0, 0, {}, []
    stats = {"iterations": 0, "gpu_decode_rows": 0, "cpu_decode_rows": 0, "modes": {}}
    while next_arrival < len(seqs) or live:
        while next_arrival < len(seqs) and seqs[next_arrival].arrival_time <= clock:
            seq = seqs[next_arrival]
            sched.add(seq)
            live[seq.request_id] = next_arrival
            next_arrival += 1
        sched.swaps_landed(in_flight)
        in_flight = []
        out = sched.schedule()
        if out.is_empty:
            clock = seqs[next_arrival].arrival_time if next_arrival < len(seqs) else clock + 1e-3
            continue
        swapped = sum(len(swap.device_blocks) for swap in out.swap_in + out.swap_out)
        step = iteration_time(roof, perf, out)
        perf.observe_iteration(out.predicted_time, step, bool(out.cpu_decodes))  # as the engine corrects its model
        swap_s = swapped * block_bytes / SWAP_BYTES_PER_S
        clock += step + swap_s
        if log is not None:
            log.append(log_row(sched, out, clock, step, swap_s))
        stats["iterations"] += 1
        stats["gpu_decode_rows"] += len(out.gpu_decodes)
        stats["cpu_decode_rows"] += len(out.cpu_decodes)
        stats["modes"][out.mode] = stats["modes"].get(out.mode, 0) + 1
        for seq, n in out.scheduled():
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < len(seq.token_ids):
                continue
            seq.token_ids.append(0)
            rec = records[live[seq.request_id]]
            rec.first = rec.first if rec.first is not None else clock
            rec.tokens += 1
            rec.token_times.append(clock)
            if seq.num_output_tokens >= seq.params.max_tokens:
                rec.end = clock
                sched.remove(seq)
                del live[seq.request_id]
        offloads = sched.offload([s for s in out.offload_after_step if s.request_id in live])
        in_flight = [swap.request_id for swap in offloads]
    stats.update(
        preemptions=sched.num_preemptions, swap_out_blocks=sched.swap_out_blocks, swap_in_blocks=sched.swap_in_blocks
    )
    return records, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["a10g", "t4mem"], default="a10g")
    parser.add_argument("--policies", nargs="+", default=["never", "auto", "always"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.5, 1, 1.5, 2, 2.5, 3])
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument(
        "--seconds-per-rate",
        type=float,
        help="instead of --num-requests: rate x this many requests per rate, the trace bench/serving.py replays",
    )
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=60.0,
        help="requests arriving this early in a trace are left out of its figures",
    )
    parser.add_argument(
        "--fit", choices=sorted(FITS), default="h200", help="the machine whose 8-SM partition and host to model"
    )
    parser.add_argument("--gpu-bw", type=float, help="instead of the fit's: the bytes/s the device's decodes read")
    parser.add_argument("--host-bw", type=float, help="instead of the fit's: the host attention's read rate")
    parser.add_argument(
        "--host-fixed-s", type=float, help="instead of the fit's: what an iteration with host work costs beyond it"
    )
    parser.add_argument(
        "--pipelined-extra-s",
        type=float,
        help="instead of the fit's: what a pipelined iteration costs beyond the model's formula",
    )
    parser.add_argument("--num-gpu-blocks", type=int, help="the device KV pool (default: the setting's)")
    parser.add_argument(
        "--knob",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="an EngineConfig knob, e.g. --knob cpu_latency_slack 2",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--iteration-log",
        type=Path,
        help="JSON lines of every simulated iteration, as bench/serving.py --iteration-log writes them "
        "(read them with bench/iterations.py)",
    )
    args = parser.parse_args()
    overrides = {name: getattr(args, name) for name in Fit.__dataclass_fields__ if getattr(args, name) is not None}
    roof, gpu_blocks, cpu_gb = setting(args.setting, replace(FITS[args.fit], **overrides))
    gpu_blocks = args.num_gpu_blocks or gpu_blocks
    knobs = EngineConfig.from_strings(dict(args.knob)).__dict__
    knobs = {k: knobs[k] for k, _ in args.knob}
    results: dict[str, list[dict]] = {}
    iteration_rows: list[dict] = []
    for policy in args.policies:
        results[policy] = []
        for rate in args.rates:
            num = trace_length(rate, args.seconds_per_rate, args.num_requests)
            trace = make_trace(num, rate, "a10g", 1000, int(rate * 1000))
            log: list[dict] | None = [] if args.iteration_log else None
            records, stats = simulate(policy, roof, gpu_blocks, cpu_gb, trace, knobs, log)
            iteration_rows.extend({"run": f"{policy} {rate_label(rate)}", **row} for row in log or [])
            measured = [r for r in records if r.start >= args.warmup_seconds]
            if not measured:
                raise SystemExit(
                    f"rate {rate}: every request arrives within --warmup-seconds {args.warmup_seconds:g}; "
                    "lengthen the trace (--seconds-per-rate, --num-requests) or shorten the warm-up"
                )
            row = {"rate": rate, **summarize(measured), "stats": stats}
            results[policy].append(row)
            print(
                f"{policy:6s} rate {rate:5.2f}: {row['output_tokens_per_s']:6.0f} tok/s  per-token "
                f"{row['mean_per_token_latency_s']:.3f} s  TPOT p99 {row['tpot_p99_s']:.3f}  TTFT p50 "
                f"{row['ttft_p50_s']:.2f} p99 {row['ttft_p99_s']:.2f}  rows gpu/cpu "
                f"{stats['gpu_decode_rows'] / stats['iterations']:.1f}/"
                f"{stats['cpu_decode_rows'] / stats['iterations']:.1f}  modes {stats['modes']}  "
                f"preempt {stats['preemptions']} swap out/in {stats['swap_out_blocks']}/{stats['swap_in_blocks']}",
                flush=True,
            )
    metric = paper_metric(results)
    print(json.dumps(metric))
    if args.json:
        args.json.write_text(json.dumps({"metric": metric, "results": results}, indent=1))
    if args.iteration_log:
        args.iteration_log.write_text("".join(json.dumps(row) + "\n" for row in iteration_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
