"""Block swaps between the device KV pool and the host KV pool.

Swaps run on their own CUDA stream: a swap-out gathers the request's device blocks into a staging buffer and
copies it to pinned memory; it completes (scatter into the host pool, device blocks freed) at the start of
a later step once the copy has landed, or at once where the scheduler needs its device blocks now. A swap-in
gathers host blocks into pinned staging, copies them up and scatters them into the device pool on the copy
stream; the compute stream waits on its event before using them. The host-side gathers and scatters are the
CPU library's block copies (`Kernels.copy_blocks`), memcpy on the attention team's thread count.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..cpu.ops import Kernels
from .host_pool import HostKVCache


@dataclass
class _PendingSwapOut:
    request_id: str
    host_blocks: torch.Tensor
    staging: list[torch.Tensor]  # per layer: [2, n, block_size, Hkv, D] on the host
    done: torch.cuda.Event | None
    release: list[int] = field(default_factory=list)  # device blocks to free once the copy has finished


class BlockSwapper:
    """Copies KV blocks between the device pool (`device_k`/`device_v`, per layer) and the host pool."""

    def __init__(
        self,
        device_k: list[torch.Tensor],
        device_v: list[torch.Tensor],
        host: HostKVCache,
        device: torch.device,
        kernels: Kernels,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`kernels`: the host-side block copies' library and team; `stream`: where the copies run on CUDA
        (default: a new stream)."""
        self.device_k, self.device_v, self.host = device_k, device_v, host
        self.device = device
        self.kernels = kernels
        self.stream = stream or (torch.cuda.Stream(device) if device.type == "cuda" else None)
        self._pending: list[_PendingSwapOut] = []
        self._swap_in_done: torch.cuda.Event | None = None

    def swap_out(self, request_id: str, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Start copying device blocks to host blocks; `complete` finishes it and returns the device blocks."""
        staging = []
        with self._on_copy_stream():
            src = self._device_ids(device_blocks)
            for k, v in zip(self.device_k, self.device_v):
                gathered = torch.stack((k.index_select(0, src), v.index_select(0, src)))
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=self.stream is not None)
                host.copy_(gathered, non_blocking=True)
                staging.append(host)
            done = self._record()
        self._pending.append(
            _PendingSwapOut(request_id, torch.tensor(host_blocks, dtype=torch.long), staging, done, list(device_blocks))
        )

    def in_transit(self, request_id: str) -> bool:
        return any(swap.request_id == request_id for swap in self._pending)

    def complete(self, wait: bool = True, only: list[str] | None = None) -> list[int]:
        """Finish started swap-outs: every one (`wait`), or only those whose copy has already landed, so a
        freshly prefilled request moves to the host pool while the device computes, or those of the requests in
        `only` (waiting for them: what another rank landed). Scatters them into the host pool and returns the
        device blocks that are now free."""
        freed, still = [], []
        for swap in self._pending:
            if only is not None:
                chosen = swap.request_id in only
            else:
                chosen = wait or swap.done is None or swap.done.query()
            if not chosen:
                still.append(swap)
                continue
            if swap.done is not None:
                swap.done.synchronize()
            staged_ids = torch.arange(len(swap.host_blocks))
            for layer, staged in enumerate(swap.staging):
                self.kernels.copy_blocks(self.host.k_caches[layer], swap.host_blocks, staged[0], staged_ids)
                self.kernels.copy_blocks(self.host.v_caches[layer], swap.host_blocks, staged[1], staged_ids)
            freed += swap.release
        self._pending = still
        return freed

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks to device blocks; compute waits for it via `wait_swap_in`."""
        src, staged_ids = torch.tensor(host_blocks, dtype=torch.long), torch.arange(len(host_blocks))
        with self._on_copy_stream():
            dst = self._device_ids(device_blocks)
            for k, v, hk, hv in zip(self.device_k, self.device_v, self.host.k_caches, self.host.v_caches):
                # gathered straight into pinned staging: one host copy, on the launching thread's clock
                staged = torch.empty(
                    (2, len(host_blocks), *hk.shape[1:]), dtype=hk.dtype, pin_memory=self.stream is not None
                )
                self.kernels.copy_blocks(staged[0], staged_ids, hk, src)
                self.kernels.copy_blocks(staged[1], staged_ids, hv, src)
                up = staged.to(self.device, non_blocking=True)
                k.index_copy_(0, dst, up[0])
                v.index_copy_(0, dst, up[1])
            self._swap_in_done = self._record()

    def wait_swap_in(self) -> None:
        """Make the compute stream wait for swap-ins started so far."""
        if self._swap_in_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._swap_in_done)
            self._swap_in_done = None

    def _on_copy_stream(self):
        """The copy stream, after the work queued so far. Tensors a swap uses on it are allocated under it: the
        caching allocator would hand a compute-stream tensor to the next step while the copy still reads it."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, copied on the current stream without a wait: a blocking copy on the copy
        stream would hold the scheduler until every swap queued before had landed."""
        return torch.tensor(ids, dtype=torch.long, pin_memory=self.stream is not None).to(
            self.device, non_blocking=True
        )

    def _record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event
