"""A Triton GEMM for decode-sized row counts, `x @ w.T` with x [rows <= MAX_ROWS, K] and w [N, K].

At decode batch sizes a GEMM is the read of its weight, and what limits it is how evenly that read spreads over
the SMs. Here the weight is the MMA's wide operand (the rows are its narrow one, padded to 16), the output is tiled
in `block_n` columns, and the K dimension is split over `splits` programs whose fp32 partial sums a second kernel
adds, so that a shape's read gives every SM a program. Which tiling, if any, beats cuBLAS is measured per shape and
row count by `executor/gemm_libraries.py` (on an H100 it is taken for the FFN's gate/up up to 64 rows and for the
o and down projections at a few rows: bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton compiler
    triton = None

MAX_ROWS = 64
DTYPES = (torch.bfloat16, torch.float16)  # in fp32 the MMA would round its inputs to tf32, which cuBLAS does not
# (block_n, block_k, num_stages) of the tilings timed: narrow and wide output tiles, and a longer K step with fewer
# stages (the shared memory a stage takes grows with it)
TILES = ((64, 128, 4), (128, 128, 4), (64, 256, 3))
SPLITS = (1, 2, 4, 8)
SUM_BLOCK = 1024


@dataclass(frozen=True)
class Tiling:
    block_n: int
    block_k: int
    splits: int
    stages: int

    def __str__(self) -> str:
        return f"Triton {self.block_n}x{self.block_k}/{self.splits}"


def tilings(rows: int, in_features: int, out_features: int, num_sms: int) -> list[Tiling]:
    """The tilings worth timing for a GEMM of `rows` rows on `num_sms` SMs: per tile shape, the fewest K splits
    that give every SM a program (or the most that divide K where none does); none past MAX_ROWS."""
    if rows > MAX_ROWS:
        return []
    found = []
    for block_n, block_k, stages in TILES:
        splits = [s for s in SPLITS if out_features % block_n == 0 and in_features % (block_k * s) == 0]
        if splits:
            enough = [s for s in splits if out_features // block_n * s >= num_sms]
            found.append(Tiling(block_n, block_k, enough[0] if enough else splits[-1], stages))
    return found


def linear(x: torch.Tensor, weight: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight)` for x [rows <= MAX_ROWS, K] on `tiling` (one of `tilings`)."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    split = tiling.splits > 1
    partial = torch.empty(tiling.splits, rows, n, dtype=torch.float32, device=x.device) if split else out
    _gemm_kernel[(n // tiling.block_n, tiling.splits)](
        x,
        weight,
        out,
        partial,
        rows,
        n,
        k // tiling.splits,
        x.stride(0),
        weight.stride(0),
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        SPLIT=split,
        num_stages=tiling.stages,
        num_warps=4,
    )
    if split:
        _sum_splits_kernel[(triton.cdiv(rows * n, SUM_BLOCK),)](
            partial, out, rows * n, SPLITS=tiling.splits, BLOCK=SUM_BLOCK, num_warps=4
        )
    return out


if triton is not None:

    @triton.jit
    def _gemm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        partial_ptr,
        rows,
        n,
        k_per_split,
        stride_x,
        stride_w,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """One program: `BLOCK_N` output columns of every row over one split of K, as [BLOCK_N, BLOCK_ROWS]."""
        col = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = tl.arange(0, BLOCK_ROWS)
        ks = tl.program_id(1) * k_per_split + tl.arange(0, BLOCK_K)
        row_ok = row[None, :] < rows
        w_ptrs = w_ptr + col[:, None] * stride_w + ks[None, :]
        x_ptrs = x_ptr + row[None, :] * stride_x + ks[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_ROWS], dtype=tl.float32)
        for _ in range(0, k_per_split, BLOCK_K):
            acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs, mask=row_ok, other=0.0), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        offsets = row[None, :] * n + col[:, None]
        if SPLIT:
            tl.store(partial_ptr + tl.program_id(1) * rows * n + offsets, acc, mask=row_ok)
        else:
            tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _sum_splits_kernel(partial_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < size
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(partial_ptr + s * size + offsets, mask=ok, other=0.0)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)
