"""Does the asymmetric pipeline overlap? One iteration, timed three ways on the same sub-batches:

- pipelined: the real executor, GPU dense work of one sub-batch under the CPU attention of the other;
- GPU part alone: the same executor with the CPU attention answered instantly (no kernel);
- CPU part alone: the CPU side of that iteration (the same library loop, every layer of every lane), with
  its inputs captured and every step ready at once.

    python bench/pipeline_overlap.py --device cuda      # Llama-3-8B-shaped dummy weights, bf16

Prints, per CPU batch size, pipelined / max(GPU alone, CPU alone); 1.0 is perfect overlap. With `--split` equal
to the CPU decodes (`--sequential`), sub-batch 1 is empty: the sequential mode, where each layer's host attention
runs beside the device rows' attention and the device waits for it, so an iteration is about the GPU part alone
less the device's attention plus the kernel's own time in that iteration (`cpu_kernel_ms`); what is left over is
what the per-layer hand-offs cost. The host pool's blocks in use are written first, so the kernel reads DRAM,
not the kernel's zero page. `predicted_ms` is the performance model's time for that iteration.

`--profile DIR` also records one pipelined iteration and one GPU-part-alone iteration per CPU batch size with
`torch.profiler` (Chrome traces in DIR) and adds where the device's time went: kernels, copies, the union of the
two (`busy_ms`) and the rest of the iteration's span (`idle_ms`: launches, hand-offs, waits on the host), and
the kernels that took the most time.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import LLAMA3_8B, placed_sequence, take_blocks  # noqa: E402

from neo_backend import EngineConfig, LLMEngine  # noqa: E402
from neo_backend.core.sequence import Placement  # noqa: E402
from neo_backend.cpu.handoff import Flags, IterationLane  # noqa: E402
from neo_backend.executor.host_attention import HostAttention, HostDecodeBatch  # noqa: E402
from neo_backend.executor.pipeline import PipelinedExecutor  # noqa: E402
from neo_backend.layers.parallel import TensorParallel  # noqa: E402
from neo_backend.timing import median_seconds, sync  # noqa: E402

KERNEL_REPS = 5


def host_steps(lanes: list[IterationLane], num_layers: int):
    """The steps of `HostAttention.run_iteration`, in its order, each once its ready flag is set."""
    step = 0
    for layer in range(num_layers):
        for lane in lanes:
            lane.ready.wait(layer, 60.0)
            yield step, layer, lane
            step += 1


class CapturingHostAttention(HostAttention):
    """Runs the real kernel step by step and keeps each lane's first-layer inputs, to replay the CPU part
    alone through the same library loop as the pipeline (`run_iteration`) with every ready flag set."""

    def __init__(self, inner: HostAttention) -> None:
        super().__init__(inner.host, inner.scale, inner.device, inner.num_threads, inner.engine_cpu, TensorParallel())
        self.lanes: list[IterationLane] = []

    def run_iteration(self, lanes, done, timeout_s):
        num_layers = len(self.host.k_caches)
        for step, layer, lane in host_steps(lanes, num_layers):
            if layer == 0:
                always_ready = Flags(num_layers, 0.0)
                always_ready.values[:] = 1
                self.lanes.append(
                    IterationLane(
                        lane.q.clone(),
                        lane.k.clone(),
                        lane.v.clone(),
                        lane.out.clone(),
                        lane.block_tables,
                        lane.context_lens,
                        lane.slots,
                        always_ready,
                    )
                )
            batch = HostDecodeBatch(lane.block_tables, lane.context_lens, lane.slots)
            q, k, v = (t.contiguous() for t in (lane.q, lane.k, lane.v))  # views of the packed hand-off buffer
            self.run(layer, batch, q, k, v, lane.out)
            done.set(step)


class InstantHostAttention(HostAttention):
    """Answers the CPU attention at once: what the iteration costs the GPU alone."""

    def __init__(self, inner: HostAttention) -> None:
        super().__init__(inner.host, inner.scale, inner.device, inner.num_threads, inner.engine_cpu, TensorParallel())

    def run_iteration(self, lanes, done, timeout_s):
        for step, _, _ in host_steps(lanes, len(self.host.k_caches)):
            done.set(step)  # the output buffer keeps what it held


def build_iteration(engine: LLMEngine, gpu_decodes: int, cpu_decodes: int, context: int, split: int, seed: int):
    rng = random.Random(seed)
    runner = engine.runner
    per_seq = (context + runner.block_size - 1) // runner.block_size
    vocab = engine.model_config.vocab_size
    gpu_pool = take_blocks(runner.num_gpu_blocks, gpu_decodes * per_seq, rng)
    cpu_pool = take_blocks(runner.num_cpu_blocks, cpu_decodes * per_seq, rng)
    written = torch.tensor(cpu_pool, dtype=torch.long)
    for cache in runner.host_cache.k_caches + runner.host_cache.v_caches:
        cache.index_fill_(0, written, 0.01)
    gpu = [
        placed_sequence(f"g{i}", context, gpu_pool[i * per_seq : (i + 1) * per_seq], Placement.GPU, vocab)
        for i in range(gpu_decodes)
    ]
    cpu = [
        placed_sequence(f"c{i}", context, cpu_pool[i * per_seq : (i + 1) * per_seq], Placement.CPU, vocab)
        for i in range(cpu_decodes)
    ]
    subs = [runner.prepare([], gpu, cpu[:split]).sub]
    if split < cpu_decodes:
        subs.append(runner.prepare([], [], cpu[split:]).sub)
    return subs


def device_time(call: Callable[[], object], device: torch.device, trace: Path) -> dict:
    """One call of `call` under torch.profiler, written to `trace`: the device's kernel and copy time, their union
    and the idle rest of the span from the first device activity to the last."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        call()
        sync(device)
    prof.export_chrome_trace(str(trace))
    spans = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    is_copy = [e.name.startswith(("Memcpy", "Memset")) for e in spans]
    busy, end = 0.0, None
    for e in sorted(spans, key=lambda e: e.time_range.start):
        start, stop = e.time_range.start, e.time_range.end
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    wall = max(e.time_range.end for e in spans) - min(e.time_range.start for e in spans)
    kernels: dict[str, float] = {}
    for e, copy in zip(spans, is_copy):
        if not copy:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us()
    return {
        "span_ms": wall / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (wall - busy) / 1e3,
        "kernels_ms": sum(kernels.values()) / 1e3,
        "copies_ms": sum(e.time_range.elapsed_us() for e, c in zip(spans, is_copy) if c) / 1e3,
        "copies": sum(is_copy),
        "top_kernels_ms": {name[:80]: us / 1e3 for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]},
    }


def measure(
    engine: LLMEngine, gpu_decodes: int, cpu_decodes: int, context: int, split: int | None, profile: Path | None
) -> dict:
    runner = engine.runner
    device, model = runner.device, runner.model
    if split is None:
        _, pipelined, split = engine.scheduler.best_mode(gpu_decodes, gpu_decodes * context, [context] * cpu_decodes)
        split = split if pipelined else cpu_decodes
    split = min(split, cpu_decodes)
    subs = build_iteration(engine, gpu_decodes, cpu_decodes, context, split, seed=cpu_decodes)
    hand_offs, lane_graphs, host_attention = (
        runner.pipeline.hand_offs,
        runner.pipeline.lane_graphs,
        runner.host_attention,
    )
    real = PipelinedExecutor(host_attention, hand_offs, lane_graphs)
    instant = PipelinedExecutor(InstantHostAttention(host_attention), hand_offs, lane_graphs)
    capture = CapturingHostAttention(host_attention)
    with torch.inference_mode():
        real.run(model, subs)
        sync(device)
        host_attention.seconds = 0.0
        pipelined = median_seconds(lambda: real.run(model, subs), KERNEL_REPS, device=device)
        cpu_kernel = host_attention.seconds / KERNEL_REPS
        gpu_alone = median_seconds(lambda: instant.run(model, subs), device=device, warmup=1)
        PipelinedExecutor(capture, hand_offs, lane_graphs).run(model, subs)
        done = Flags(len(capture.lanes) * len(model.layers), 0.0)

        def cpu_part() -> None:
            done.reset(done.size)
            host_attention.run_iteration(capture.lanes, done, 60.0)

        cpu_alone = median_seconds(cpu_part, device=device, warmup=1)
        profiles = {}
        if profile is not None:
            for kind, executor in (("pipelined", real), ("gpu_alone", instant)):
                trace = profile / f"iteration_{gpu_decodes}gpu_{cpu_decodes}cpu_{kind}.json"
                profiles[kind] = device_time(lambda: executor.run(model, subs), device, trace)
    for executor in (real, instant):
        executor.shutdown()
    predicted = engine.scheduler.perf.iteration(
        gpu_decodes, gpu_decodes * context, [context] * cpu_decodes, None if split == cpu_decodes else split
    )
    return {
        "gpu_decodes": gpu_decodes,
        "cpu_decodes": cpu_decodes,
        "context": context,
        "split": split,
        "pipelined_ms": pipelined * 1e3,
        "gpu_alone_ms": gpu_alone * 1e3,
        "cpu_alone_ms": cpu_alone * 1e3,
        "cpu_kernel_ms": cpu_kernel * 1e3,
        "predicted_ms": predicted * 1e3,
        "overlap_ratio": pipelined / max(gpu_alone, cpu_alone),
        **({"profile": profiles} if profiles else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-decodes", type=int, default=64)
    parser.add_argument("--cpu-decodes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--split", type=int, help="CPU decodes in sub-batch 0 (default: the scheduler's choice)")
    parser.add_argument("--sequential", action="store_true", help="every CPU decode in sub-batch 0 (--split N)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, metavar="DIR", help="also profile one iteration of each kind")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model is None:
        args.model, args.load_format = LLAMA3_8B, "dummy"
    args.offload_policy = "always"
    args.cpu_kv_cache_gb = args.cpu_kv_cache_gb or 8
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    if args.profile:
        if not torch.cuda.is_available():
            parser.error("--profile records the device's time: it needs CUDA")
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = [
        measure(engine, args.gpu_decodes, n, args.context, n if args.sequential else args.split, args.profile)
        for n in args.cpu_decodes
    ]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(
        f"{'gpu':>5} {'cpu':>5} {'split':>5} {'ctx':>6} {'pipelined_ms':>13} {'gpu_alone_ms':>13} "
        f"{'cpu_alone_ms':>13} {'cpu_kernel_ms':>13} {'predicted_ms':>13} ratio"
    )
    for r in rows:
        print(
            f"{r['gpu_decodes']:5d} {r['cpu_decodes']:5d} {r['split']:5d} {r['context']:6d} "
            f"{r['pipelined_ms']:13.2f} "
            f"{r['gpu_alone_ms']:13.2f} {r['cpu_alone_ms']:13.2f} {r['cpu_kernel_ms']:13.2f} {r['predicted_ms']:13.2f} "
            f"{r['overlap_ratio']:.3f}"
        )
        for kind, p in r.get("profile", {}).items():
            print(
                f"      {kind}: span {p['span_ms']:.2f} ms, device busy {p['busy_ms']:.2f} "
                f"(kernels {p['kernels_ms']:.2f}, {p['copies']} copies {p['copies_ms']:.2f}), "
                f"idle {p['idle_ms']:.2f}; top kernels {p['top_kernels_ms']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
