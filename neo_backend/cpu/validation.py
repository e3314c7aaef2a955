"""Checks of everything handed to the library, before any C code runs: bad input raises `KernelInputError` and
never reaches the library, whose C side refuses only what it cannot compute."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import KernelInputError
from .abi import DTYPE_CODES, SUPPORTED_HEAD_DIMS
from .handoff import Flags, IterationLane


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int


def check_tensor(
    name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...], strided_rows: bool = False
) -> torch.Tensor:
    """`t` is a contiguous host tensor of `ndim` dimensions and one of `dtypes`; with `strided_rows`, contiguous
    within each row of its first dimension, the rows any distance apart beyond that."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise KernelInputError(f"{name} is on {t.device}; the CPU kernel needs host tensors")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise KernelInputError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if strided_rows and t.dim() > 1 and t.shape[0] > 1:
        if not (t[0].is_contiguous() and t.stride(0) >= t[0].numel()):
            raise KernelInputError(f"{name} must be contiguous within each row; got strides {t.stride()}")
    elif not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous (call .contiguous()); got strides {t.stride()}")
    return t


def check_thread_count(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KernelInputError(f"num_threads must be a positive int, got {n!r}")
    return n


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise KernelInputError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _check_caches(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    kv_dtypes = tuple(DTYPE_CODES)
    check_tensor("k_cache", k_cache, 4, kv_dtypes)
    check_tensor("v_cache", v_cache, 4, kv_dtypes)
    if v_cache.dtype != k_cache.dtype:
        raise KernelInputError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    _check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_blocks, block_size, hkv, d = k_cache.shape
    if block_size < 1 or hkv < 1:
        raise KernelInputError(f"k_cache shape {tuple(k_cache.shape)} has an empty block or head dimension")
    return num_blocks, block_size, hkv, d


def check_attention(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    context_lens: object,
    scale: object,
    out: object,
    strided_rows: bool = False,
) -> AttentionShape:
    """The arguments of `Kernels.paged_decode_attention`, which documents them; `strided_rows`: q's rows may lie
    apart (`neo_decode_iteration` takes their stride)."""
    num_blocks, block_size, hkv, d = _check_caches(k_cache, v_cache)
    if d not in SUPPORTED_HEAD_DIMS:
        raise KernelInputError(f"head_dim {d} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    check_tensor("q", q, 3, (k_cache.dtype, torch.float32), strided_rows)
    b, hq, _ = q.shape
    _check_shape("q", q, (b, hq, d))
    if hq == 0 or hq % hkv:
        raise KernelInputError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv})")
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    max_blocks = block_tables.shape[1]
    _check_shape("block_tables", block_tables, (b, max_blocks))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    _check_shape("context_lens", context_lens, (b,))
    check_tensor("out", out, 3, (q.dtype,))
    _check_shape("out", out, tuple(q.shape))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise KernelInputError(f"scale must be a finite float, got {scale!r}")
    if b:
        _check_block_tables(block_tables, context_lens, block_size, num_blocks)
    return AttentionShape(b, hq, hkv, d, block_size, max_blocks)


def _check_block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """Context lengths fit the table, and every entry the kernel will read names an existing block."""
    # numpy: a few microseconds per operation where torch dispatch costs tens, on every decode step.
    ctx, tables = context_lens.numpy(), block_tables.numpy()
    lo, hi = int(ctx.min()), int(ctx.max())
    if lo < 1:
        raise KernelInputError(f"context_lens must be >= 1 (they include the current token); got {lo}")
    if hi > tables.shape[1] * block_size:
        raise KernelInputError(
            f"context length {hi} exceeds the block table's capacity ({tables.shape[1]} blocks x {block_size} tokens)"
        )
    used = np.arange(tables.shape[1]) < ((ctx + (block_size - 1)) // block_size)[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        raise KernelInputError(
            f"block_tables holds block id {int(tables[bad][0])} within a context, outside the cache's [0, {num_blocks})"
        )


def check_append(
    k: object, v: object, k_cache: object, v_cache: object, slot_mapping: object, strided_rows: bool = False
) -> None:
    """The arguments of `Kernels.append_kv`, which documents them; `strided_rows`: k's and v's rows may lie apart,
    the same distance in both (`neo_decode_iteration` takes it)."""
    num_blocks, block_size, hkv, d = _check_caches(k_cache, v_cache)
    check_tensor("k", k, 3, (k_cache.dtype,), strided_rows)
    b = k.shape[0]
    _check_shape("k", k, (b, hkv, d))
    check_tensor("v", v, 3, (k_cache.dtype,), strided_rows)
    _check_shape("v", v, (b, hkv, d))
    if b > 1 and k.stride(0) != v.stride(0):
        raise KernelInputError(f"k's rows are {k.stride(0)} elements apart and v's {v.stride(0)}: they must match")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    _check_shape("slot_mapping", slot_mapping, (b,))
    if b == 0:
        return
    slots = slot_mapping.numpy()
    lo, hi = int(slots.min()), int(slots.max())
    if lo < 0 or hi >= num_blocks * block_size:
        raise KernelInputError(
            f"slot_mapping holds slot {lo if lo < 0 else hi}, outside the cache's [0, {num_blocks * block_size})"
        )


def check_iteration(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], lanes: list[IterationLane], done: Flags, scale: float
) -> list[AttentionShape]:
    """The arguments of `Kernels.decode_iteration`, once per lane: every layer's caches share layer 0's shape,
    so the library can attend over all of them with the same checked inputs. Returns each lane's shape."""
    num_layers = len(k_caches)
    if len(v_caches) != num_layers or not lanes:
        raise KernelInputError(
            f"need one v cache per k cache and at least one lane; got {num_layers} k, "
            f"{len(v_caches)} v caches and {len(lanes)} lanes"
        )
    for k_cache, v_cache in zip(k_caches, v_caches):
        if (
            k_cache.shape != k_caches[0].shape
            or v_cache.shape != k_cache.shape
            or k_cache.dtype != k_caches[0].dtype
            or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            raise KernelInputError("every layer's k/v caches must be contiguous with layer 0's shape and dtype")
    shapes = []
    for lane in lanes:
        shapes.append(
            check_attention(
                lane.q,
                k_caches[0],
                v_caches[0],
                lane.block_tables,
                lane.context_lens,
                scale,
                lane.out,
                strided_rows=True,
            )
        )
        check_append(lane.k, lane.v, k_caches[0], v_caches[0], lane.slots, strided_rows=True)
        if lane.ready.values.size < num_layers:
            raise KernelInputError(f"a lane has {lane.ready.values.size} ready flags for {num_layers} layers")
        if lane.q.dtype != lanes[0].q.dtype or shapes[-1].q_heads != shapes[0].q_heads:
            raise KernelInputError("every lane's q must have the same dtype and number of heads")
    num_steps = num_layers * len(lanes)
    if done.values.size < num_steps:
        raise KernelInputError(f"{done.values.size} done flags for {num_steps} steps")
    return shapes
