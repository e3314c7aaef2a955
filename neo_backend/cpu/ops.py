"""The library's operations: tensors checked by `validation`, then one ctypes call each (GIL released).

dtypes: the KV cache is fp16, bf16 or fp32. `q` is either the cache's dtype or fp32, and the output has
q's dtype (all arithmetic is fp32; pass fp32 q to get unrounded fp32 output from a 16-bit cache).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import KernelError
from .abi import DTYPE_CODES, IterationStatus, Status, StepField
from .handoff import Flags, IterationLane
from .validation import (
    AttentionShape,
    check_append,
    check_attention,
    check_iteration,
    check_thread_count,
)

_STATUS_MESSAGES = {
    Status.UNSUPPORTED: "unsupported dtype or head_dim",
    Status.NO_MEMORY: "out of memory",
    Status.BAD_ARGUMENT: "invalid argument",
    IterationStatus.HAND_OFF_TIMED_OUT: "a hand-off timed out",
    IterationStatus.ABANDONED: "abandoned by the launching thread",
}


@dataclass(frozen=True)
class Kernels:
    """The kernels of one loaded library (`library.default()`, or another build to compare against), each call
    run by an OpenMP team of `num_threads`."""

    lib: ctypes.CDLL
    num_threads: int

    def __post_init__(self) -> None:
        check_thread_count(self.num_threads)

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        split_long: bool = True,
    ) -> torch.Tensor:
        """Decode attention of one query token per sequence over a paged KV cache.

        q [B, Hq, D] (cache dtype or fp32); k_cache/v_cache [num_blocks, block_size, Hkv, D];
        block_tables int32 [B, max_blocks]; context_lens int32 [B], each >= 1 and counting the current token,
        whose k/v must already be in the cache (see `append_kv`). Hq must be a multiple of Hkv (GQA).
        Returns `out` [B, Hq, D] in q's dtype (allocated when None). `split_long` lets long sequences be
        split across threads and merged exactly (log-sum-exp); results then differ from the unsplit ones
        only by fp32 rounding.
        """
        if out is None:
            out = torch.empty_like(q) if isinstance(q, torch.Tensor) else None
        shape = check_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out)
        if shape.batch == 0:
            return out
        status = self.lib.neo_paged_attention(
            q.data_ptr(),
            DTYPE_CODES[q.dtype],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            DTYPE_CODES[k_cache.dtype],
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            shape.batch,
            shape.q_heads,
            shape.kv_heads,
            shape.head_dim,
            shape.block_size,
            shape.max_blocks,
            float(scale),
            self.num_threads,
            int(bool(split_long)),
        )
        if status != Status.OK:
            raise KernelError(f"paged_decode_attention failed in the library: {_describe(status)}")
        return out

    def append_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Writes each sequence's new token k/v [B, Hkv, D] at slot = block_id * block_size + offset."""
        check_append(k, v, k_cache, v_cache, slot_mapping)
        if k.shape[0]:
            self.lib.neo_append_kv(
                k.data_ptr(),
                v.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                slot_mapping.data_ptr(),
                k.shape[0],
                k.shape[1] * k.shape[2] * k.element_size(),
            )

    def decode_iteration(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        lanes: list[IterationLane],
        done: Flags,
        scale: float,
        timeout_s: float,
    ) -> np.ndarray:
        """The CPU side of a pipelined iteration in one library call (GIL released throughout): for each layer,
        for each lane, wait for its ready flag, append k/v to that layer's caches, attend into `out`, set the
        step's done flag (step = layer * len(lanes) + lane). Returns the seconds of each step. If the launching
        side marks a ready flag failed, the remaining steps are skipped and their done flags failed too.
        """
        shapes = check_iteration(k_caches, v_caches, lanes, done, scale)
        table = _step_table(k_caches, v_caches, lanes, shapes, done)
        num_steps = len(k_caches) * len(lanes)
        seconds = np.zeros(num_steps)
        first = shapes[0]
        status = self.lib.neo_decode_iteration(
            table.ctypes.data,
            num_steps,
            DTYPE_CODES[lanes[0].q.dtype],
            DTYPE_CODES[k_caches[0].dtype],
            first.q_heads,
            first.kv_heads,
            first.head_dim,
            first.block_size,
            float(scale),
            self.num_threads,
            done.spin_s,
            float(timeout_s),
            seconds.ctypes.data,
        )
        if status not in (Status.OK, IterationStatus.ABANDONED):
            raise KernelError(f"decode_iteration failed in the library: {_describe(status)}")
        return seconds


def _step_table(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    lanes: list[IterationLane],
    shapes: list[AttentionShape],
    done: Flags,
) -> np.ndarray:
    """`neo_decode_iteration`'s steps, [layer, lane, StepField]: the pointers and sizes of each step."""
    num_layers = len(k_caches)
    table = np.empty((num_layers, len(lanes), len(StepField)), dtype=np.int64)
    layers = np.arange(num_layers)
    table[:, :, StepField.K_CACHE] = np.array([t.data_ptr() for t in k_caches])[:, None]
    table[:, :, StepField.V_CACHE] = np.array([t.data_ptr() for t in v_caches])[:, None]
    for i, (lane, shape) in enumerate(zip(lanes, shapes)):
        column = table[:, i]
        column[:, StepField.READY] = lane.ready.address() + 8 * layers
        column[:, StepField.DONE] = done.address() + 8 * (layers * len(lanes) + i)
        for field, tensor in (
            (StepField.Q, lane.q),
            (StepField.K_NEW, lane.k),
            (StepField.V_NEW, lane.v),
            (StepField.OUT, lane.out),
            (StepField.SLOTS, lane.slots),
            (StepField.TABLES, lane.block_tables),
            (StepField.LENS, lane.context_lens),
        ):
            column[:, field] = tensor.data_ptr()
        column[:, StepField.BATCH] = shape.batch
        column[:, StepField.MAX_BLOCKS] = shape.max_blocks
        column[:, StepField.Q_ROW_STRIDE] = lane.q.stride(0)
        column[:, StepField.KV_ROW_STRIDE] = lane.k.stride(0)
    return table


def _describe(status: int) -> str:
    return _STATUS_MESSAGES.get(status, str(status))
