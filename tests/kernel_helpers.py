"""Test helpers for the CPU attention library: its float64 reference, and forcing one of its SIMD paths."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch

from neo_backend.cpu.abi import Isa


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain float64 torch version of `Kernels.paged_decode_attention` (slow; for tests and the benchmark's check)."""
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(context_lens[i])
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].double()
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].double()
        qi = q[i].double().view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qi, k) * scale, dim=-1)
        out[i] = torch.einsum("hgt,thd->hgd", p, v).reshape(hq, d)
    return out


def available_isas(lib: ctypes.CDLL) -> list[str]:
    """The SIMD paths this CPU can run, narrowest first."""
    return [isa.name.lower() for isa in Isa if isa <= lib.neo_max_isa()]


@contextlib.contextmanager
def forced_isa(lib: ctypes.CDLL, name: str) -> Iterator[None]:
    """The library runs its `name` SIMD path inside the block, and its best one again after it."""
    assert lib.neo_set_isa(Isa[name.upper()]) == 0, f"this CPU has no {name}"
    try:
        yield
    finally:
        lib.neo_set_isa(lib.neo_max_isa())
