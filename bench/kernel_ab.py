#!/usr/bin/env python3
"""Paired A/B of two builds of the CPU attention kernel: `python bench/kernel_ab.py REV_A [REV_B]`.

Builds `kernels/` as of each git revision, or from a folder holding a copy of it (REV_B defaults to the working
tree), with the project's flags, loads both libraries into this process and calls them in alternation (A B,
B A, A B, ...) on `make bench-kernel`'s shape, KV from DRAM. On a shared machine the bandwidth drifts by tens of
percent between runs; consecutive calls see nearly the same machine, so the median of the per-pair speed ratios
resolves a few percent where two separate runs of bench/kernel.py cannot. Both revisions must have this
binding's ABI.
Dependencies: torch, git, tar and the standard library.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel import BENCH_SHAPE, Case, bench_case  # noqa: E402

from neo_backend.cpu import build, library  # noqa: E402
from neo_backend.cpu.ops import Kernels  # noqa: E402
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
    args = parser.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))

    with tempfile.TemporaryDirectory() as scratch:
        builds = [
            Kernels(library.load(build.build(kernel_dir=kernel_dir_at(rev, pathlib.Path(scratch)))), threads)
            for rev in (args.rev_a, args.rev_b)
        ]
    case = bench_case()
    for kernels in builds * 2:  # warm-up: thread teams, page faults
        timed_call(case, kernels, 0)
    ratios, speeds = [], ([], [])
    for pair in range(args.pairs):
        table = pair % len(case.tables)
        order = (0, 1) if pair % 2 == 0 else (1, 0)
        seconds = {i: timed_call(case, builds[i], table) for i in order}
        ratios.append(seconds[0] / seconds[1])
        for i in (0, 1):
            speeds[i].append(case.kv_bytes / seconds[i] / 1e9)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    print(
        f"{BENCH_SHAPE}, {threads} threads, {args.pairs} pairs: "
        f"A ({args.rev_a}) {statistics.median(speeds[0]):.2f} GB/s, B ({args.rev_b}) "
        f"{statistics.median(speeds[1]):.2f} GB/s (medians)"
    )
    print(f"speed_B_over_A={median:.3f} quartiles={q1:.3f}-{q3:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
