#!/usr/bin/env python3
"""`make bench-kernel`: builds, checks and times the CPU paged decode-attention kernel.

The figure of merit is the KV bytes the kernel reads per second over the machine's read bandwidth,
measured in the same run by a STREAM-like OpenMP read-sum in the same library (same threads, same SIMD
path) over a buffer far larger than the last-level cache. Kernel and stream timings are interleaved over
several rounds and medians are reported, because memory bandwidth on shared machines is noisy.

Each timed kernel call reads a different copy of the KV cache (the copies together are 8x the LLC, as is
the stream buffer), so no call finds its KV in cache; physical blocks are shuffled as in a long-running
engine. Both the KV copies and the stream buffer are allocated as the engine allocates its host pool (on
transparent huge pages where the system allows them).

Before it, the same calls with every block-table entry pointing into a few physical blocks that stay in L2
(`kv_hot_GBps`): the kernel's arithmetic ceiling on this machine, so the two figures say whether it is
bound by arithmetic or by memory here.

Last line: `kv_read_GBps=<x> stream_read_GBps=<y> ratio=<x/y>`. `--sweep` also writes
bench/results/kernel_sweep_<hostname>.csv over threads, batch, context and dtype.
Dependencies: torch and the standard library only.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import pathlib
import socket
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kernel_helpers import reference_paged_decode_attention  # noqa: E402

from neo_backend.cpu import build, library  # noqa: E402
from neo_backend.cpu.ops import Kernels  # noqa: E402
from neo_backend.cpu.validation import check_tensor  # noqa: E402
from neo_backend.executor.host_pool import huge_page_tensor  # noqa: E402
from neo_backend.timing import median_seconds  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Working sets are kept at >= 8x the LLC: a large LLC (300 MiB on the H200 host) otherwise keeps part of
# a repeatedly scanned buffer and inflates either figure.
LLC_MULTIPLE = 8
# Physical blocks the hot table cycles over: 4 blocks of K and V are 256 KiB at the bench shape.
HOT_BLOCKS = 4


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), or 256 MiB when it cannot be read."""
    best = 0
    for idx in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 256 << 20


class Case:
    """A decode batch over a shuffled paged KV pool holding several copies of the batch's KV."""

    def __init__(
        self,
        batch: int,
        context: int,
        hq: int,
        hkv: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = math.ceil(context / block_size)
        elt = torch.tensor([], dtype=dtype).element_size()
        self.kv_bytes = 2 * batch * context * hkv * head_dim * elt
        copy_bytes = 2 * batch * blocks_per_seq * block_size * hkv * head_dim * elt
        copies = max(2, math.ceil(LLC_MULTIPLE * llc_bytes() / copy_bytes))
        num_blocks = copies * batch * blocks_per_seq
        shape = (num_blocks, block_size, hkv, head_dim)
        self.k_cache = huge_page_tensor(shape, dtype).copy_(torch.randn(shape, generator=gen))
        self.v_cache = huge_page_tensor(shape, dtype).copy_(torch.randn(shape, generator=gen))
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.tables = [t.reshape(batch, blocks_per_seq).contiguous() for t in perm.chunk(copies)]
        self.hot_table = (torch.arange(batch * blocks_per_seq, dtype=torch.int32) % HOT_BLOCKS).reshape(
            batch, blocks_per_seq
        )
        self.context_lens = torch.full((batch,), context, dtype=torch.int32)
        self.q = torch.randn(batch, hq, head_dim, generator=gen).to(dtype)
        self.out = torch.empty_like(self.q)
        self.scale = 1.0 / math.sqrt(head_dim)
        self._next = 0

    def run(self, kernels: Kernels, table: torch.Tensor | None = None) -> None:
        """One call over block table `table`: one of `tables` or `hot_table` (default: the next KV copy's)."""
        if table is None:
            table, self._next = self.tables[self._next], (self._next + 1) % len(self.tables)
        kernels.paged_decode_attention(
            self.q, self.k_cache, self.v_cache, table, self.context_lens, self.scale, out=self.out
        )

    def check(self, kernels: Kernels) -> float:
        """Max relative error (per output row) against the float64 reference, on fp32 queries."""
        q = self.q.float()
        out = kernels.paged_decode_attention(
            q, self.k_cache, self.v_cache, self.tables[0], self.context_lens, self.scale
        )
        ref = reference_paged_decode_attention(
            q, self.k_cache, self.v_cache, self.tables[0], self.context_lens, self.scale
        )
        return float(((out.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


BENCH_SHAPE = "B=32 ctx=1024 Hq=32 Hkv=8 D=128 fp16 block=16"


def bench_case() -> Case:
    """`make bench-kernel`'s fixed shape (BENCH_SHAPE)."""
    return Case(batch=32, context=1024, hq=32, hkv=8, head_dim=128, dtype=torch.float16, block_size=16)


def stream_read(kernels: Kernels, buf: torch.Tensor) -> float:
    """Sums a float32 buffer with the kernels' threads and SIMD path: the memory-bandwidth yardstick."""
    check_tensor("buf", buf, 1, (torch.float32,))
    return kernels.lib.neo_stream_read(buf.data_ptr(), buf.numel(), kernels.num_threads)


def kernel_gbps(case: Case, kernels: Kernels, reps: int, table: torch.Tensor | None = None) -> float:
    return case.kv_bytes / median_seconds(lambda: case.run(kernels, table), reps) / 1e9


def stream_gbps(buf: torch.Tensor, kernels: Kernels, reps: int) -> float:
    return buf.numel() * buf.element_size() / median_seconds(lambda: stream_read(kernels, buf), reps) / 1e9


def measure(case: Case, buf: torch.Tensor, kernels: Kernels, rounds: int, reps: int) -> tuple[float, float]:
    """Medians over `rounds` of interleaved (kernel, stream) measurements, after one warm-up of each."""
    kernel_gbps(case, kernels, 1)
    stream_gbps(buf, kernels, 1)
    kv, st = [], []
    for _ in range(rounds):
        kv.append(kernel_gbps(case, kernels, reps))
        st.append(stream_gbps(buf, kernels, max(1, reps // 2)))
    return statistics.median(kv), statistics.median(st)


def hot_gbps(case: Case, kernels: Kernels, rounds: int, reps: int) -> float:
    """Median over `rounds` of the kernel's speed with the KV in L2 (the hot table), after one warm-up."""
    kernel_gbps(case, kernels, 1, case.hot_table)
    return statistics.median(kernel_gbps(case, kernels, reps, case.hot_table) for _ in range(rounds))


def sweep(buf: torch.Tensor, max_threads: int, rounds: int, path: pathlib.Path) -> None:
    thread_counts = sorted({t for t in (1, 2, 4, 8, 16, 32, 64) if t < max_threads} | {max_threads})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["threads", "batch", "context", "dtype", "kv_MB", "kernel_ms", "kv_read_GBps", "stream_read_GBps", "ratio"]
        )
        for dtype in DTYPES:
            for batch, context in ((8, 1024), (32, 1024), (32, 4096), (1, 16384), (64, 512)):
                case = Case(batch, context, 32, 8, 128, DTYPES[dtype], 16)
                for threads in thread_counts:
                    kv, st = measure(case, buf, Kernels(library.default(), threads), rounds, reps=5)
                    row = [
                        threads,
                        batch,
                        context,
                        dtype,
                        round(case.kv_bytes / 2**20, 1),
                        round(case.kv_bytes / kv / 1e6, 3),
                        round(kv, 2),
                        round(st, 2),
                        round(kv / st, 3),
                    ]
                    w.writerow(row)
                    f.flush()
                    print("sweep", *row, flush=True)
                del case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved kernel/stream rounds")
    parser.add_argument("--sweep", action="store_true", help="also sweep threads x batch x context x dtype to CSV")
    parser.add_argument(
        "--sweep-out",
        type=pathlib.Path,
        default=None,
        help="sweep CSV path (default: bench/results/kernel_sweep_<hostname>.csv)",
    )
    args = parser.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    kernels = Kernels(library.default(), threads)

    print(
        f"library {build.build()}; SIMD path {library.active_isa(kernels.lib)}; threads {threads}; "
        f"host {socket.gethostname()}; torch {torch.__version__}; LLC {llc_bytes() >> 20} MiB; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    case = bench_case()
    err = case.check(kernels)
    print(f"check vs float64 reference: max rel err {err:.2e}", flush=True)
    if not err <= 1e-3:
        print("FAILED: kernel output disagrees with the reference", file=sys.stderr)
        return 1
    buf = huge_page_tensor((max(1 << 30, LLC_MULTIPLE * llc_bytes()) // 4,), torch.float32).fill_(1.0)
    if args.sweep:
        sweep(
            buf,
            threads,
            max(3, args.rounds // 3),
            args.sweep_out or ROOT / "bench" / "results" / f"kernel_sweep_{socket.gethostname()}.csv",
        )
    kv, st = measure(case, buf, kernels, args.rounds, reps=7)
    hot = hot_gbps(case, kernels, args.rounds, reps=7)
    print(
        f"{BENCH_SHAPE}: {case.kv_bytes / 2**20:.0f} MiB KV per call, "
        f"{case.kv_bytes / kv / 1e6:.2f} ms per call (median of {args.rounds} rounds); "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"kv_hot_GBps={hot:.2f} (KV in L2: the arithmetic ceiling; from DRAM the kernel reaches {kv / hot:.2f} of it)"
    )
    print(f"kv_read_GBps={kv:.2f} stream_read_GBps={st:.2f} ratio={kv / st:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
