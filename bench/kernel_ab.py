#!/usr/bin/env python3
"""Paired A/B of two builds of the CPU attention kernel: `python bench/kernel_ab.py REV_A [REV_B]`.

Builds `kernels/` as of each git revision, or from a folder holding a copy of it (REV_B defaults to the working
tree), with the project's flags, loads both libraries into this process and calls them in alternation (A B,
B A, A B, ...) on `make bench-kernel`'s shape, KV from DRAM. On a shared machine the bandwidth drifts by tens of
percent between runs; consecutive calls see nearly the same machine, so the median of the per-pair speed ratios
resolves a few percent where two separate runs of bench/kernel.py cannot. Both revisions must have this
binding's ABI.

`--iteration B,CONTEXT,HQ,HKV,DTYPE` (repeatable) times whole iterations as the engine runs them instead: one
`decode_iteration` call appending to and attending over `--layers` layers, each layer its own cache, the
caches together >= 8x the LLC and every call on fresh random block tables, so the KV comes from DRAM.
Dependencies: torch, git, tar and the standard library.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel import BENCH_SHAPE, DTYPES, LLC_MULTIPLE, Case, bench_case, llc_bytes  # noqa: E402

from neo_backend.cpu import build, library  # noqa: E402
from neo_backend.cpu.handoff import Flags, IterationLane  # noqa: E402
from neo_backend.cpu.ops import Kernels  # noqa: E402
from neo_backend.executor.host_pool import huge_page_tensor  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

WORKING_TREE = "worktree"


def kernel_dir_at(rev: str, scratch: pathlib.Path) -> pathlib.Path:
    """`kernels/` as of `rev`, unpacked under `scratch`; the checkout's own folder for the working tree, `rev`
    itself where it is a folder with the sources (a machine without the git history)."""
    if rev == WORKING_TREE:
        return build.KERNEL_DIR
    if (pathlib.Path(rev) / build.MAIN_SOURCE).is_file():
        return pathlib.Path(rev)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "kernels"], capture_output=True, check=True, timeout=60
    ).stdout
    target = scratch / rev.replace("/", "_")
    target.mkdir()
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True, timeout=60)
    return target / "kernels"


def timed_call(case: Case, kernels: Kernels, table: int) -> float:
    return median_seconds(lambda: case.run(kernels, case.tables[table]), reps=1)


def timed_call_on_table(case: Case, kernels: Kernels, pair: int) -> float:
    """Pair `pair`'s call: both builds read the same KV copy, a different one each pair."""
    return timed_call(case, kernels, pair % len(case.tables))


class IterationCase:
    """One engine iteration's host attention: `batch` requests of `context` tokens over `layers` layers, each
    layer a cache of its own; every layer's inputs ready, as in the sequential mode."""

    BLOCK_SIZE = 16
    HEAD_DIM = 128

    def __init__(self, spec: str, layers: int) -> None:
        batch, context, hq, hkv, dtype = spec.split(",")
        self.name = f"B={batch} ctx={context} Hq={hq} Hkv={hkv} D={self.HEAD_DIM} {dtype}, {layers} layers"
        self.batch, self.context, hq, hkv, dtype = int(batch), int(context), int(hq), int(hkv), DTYPES[dtype]
        self.blocks_per_seq = -(-self.context // self.BLOCK_SIZE)
        elt = torch.tensor([], dtype=dtype).element_size()
        block_bytes = 2 * self.BLOCK_SIZE * hkv * self.HEAD_DIM * elt
        self.kv_bytes = 2 * self.batch * self.context * hkv * self.HEAD_DIM * elt * layers
        self.num_blocks = max(
            self.batch * self.blocks_per_seq, -(-LLC_MULTIPLE * llc_bytes() // (layers * block_bytes))
        )
        shape = (self.num_blocks, self.BLOCK_SIZE, hkv, self.HEAD_DIM)
        block = torch.randn(1, *shape[1:]).to(dtype).expand(shape)  # every block alike: random fills take minutes
        self.k_caches = [huge_page_tensor(shape, dtype).copy_(block) for _ in range(layers)]
        self.v_caches = [huge_page_tensor(shape, dtype).copy_(block) for _ in range(layers)]
        self.q = torch.randn(self.batch, hq, self.HEAD_DIM).to(dtype)
        self.kv_new = torch.randn(self.batch, hkv, self.HEAD_DIM).to(dtype)
        self.ready = Flags(layers, 0.0)
        self.ready.values[:] = 1
        self.done = Flags(layers, 0.0)
        self.calls = 0

    def lane(self) -> IterationLane:
        """Fresh random block tables for every call: none reads blocks the last one left in cache."""
        self.calls += 1
        gen = torch.Generator().manual_seed(self.calls)
        tables = torch.randint(0, self.num_blocks, (self.batch, self.blocks_per_seq), generator=gen, dtype=torch.int32)
        lens = torch.full((self.batch,), self.context, dtype=torch.int32)
        slots = tables[:, -1].long() * self.BLOCK_SIZE + (self.context - 1) % self.BLOCK_SIZE
        out = torch.empty_like(self.q)
        return IterationLane(self.q, self.kv_new, self.kv_new, out, tables, lens, slots, self.ready)

    def seconds(self, kernels: Kernels, _pair: int = 0) -> float:
        lane = self.lane()
        self.done.reset(len(self.k_caches))
        start = time.perf_counter()
        kernels.decode_iteration(self.k_caches, self.v_caches, [lane], self.done, self.HEAD_DIM**-0.5, 60.0)
        return time.perf_counter() - start


def paired_ratios(time_a, time_b, pairs: int) -> tuple[list[float], list[float], list[float]]:
    """Per pair (A B, then B A, ...): A's time over B's, and each side's seconds."""
    ratios, seconds_a, seconds_b = [], [], []
    for pair in range(pairs):
        if pair % 2 == 0:
            a, b = time_a(pair), time_b(pair)
        else:
            b, a = time_b(pair), time_a(pair)
        ratios.append(a / b)
        seconds_a.append(a)
        seconds_b.append(b)
    return ratios, seconds_a, seconds_b


def report(name: str, threads: int, pairs: int, kv_bytes: int, revs, result) -> None:
    ratios, seconds_a, seconds_b = result
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    speeds = [kv_bytes / statistics.median(s) / 1e9 for s in (seconds_a, seconds_b)]
    print(
        f"{name}, {threads} threads, {pairs} pairs: A ({revs[0]}) {speeds[0]:.2f} GB/s, "
        f"B ({revs[1]}) {speeds[1]:.2f} GB/s (medians)"
    )
    print(f"speed_B_over_A={median:.3f} quartiles={q1:.3f}-{q3:.3f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rev_a", help="git revision (or kernels/ folder) of build A")
    parser.add_argument(
        "rev_b",
        nargs="?",
        default=WORKING_TREE,
        help="git revision (or kernels/ folder) of build B (default: the working tree)",
    )
    parser.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument(
        "--iteration",
        action="append",
        default=[],
        metavar="B,CONTEXT,HQ,HKV,DTYPE",
        help="time whole iterations of this shape (repeatable; DTYPE fp16, bf16 or fp32), e.g. 2,1100,32,32,bf16",
    )
    parser.add_argument("--layers", type=int, default=32, help="layers of an --iteration")
    args = parser.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))

    with tempfile.TemporaryDirectory() as scratch:
        builds = [
            Kernels(library.load(build.build(kernel_dir=kernel_dir_at(rev, pathlib.Path(scratch)))), threads)
            for rev in (args.rev_a, args.rev_b)
        ]
    revs = (args.rev_a, args.rev_b)
    if not args.iteration:
        bench = bench_case()
        for kernels in builds * 2:  # warm-up: thread teams, page faults
            timed_call(bench, kernels, 0)
        timers = [functools.partial(timed_call_on_table, bench, kernels) for kernels in builds]
        report(BENCH_SHAPE, threads, args.pairs, bench.kv_bytes, revs, paired_ratios(*timers, args.pairs))
        return 0
    for spec in args.iteration:
        iteration = IterationCase(spec, args.layers)
        for kernels in builds * 2:
            iteration.seconds(kernels)
        timers = [functools.partial(iteration.seconds, kernels) for kernels in builds]
        report(iteration.name, threads, args.pairs, iteration.kv_bytes, revs, paired_ratios(*timers, args.pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
