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
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from ..cpu.ops import Kernels
from ..errors import SchedulerError
from .host_pool import HostKVCache, check_host_memory

log = logging.getLogger("neo_backend")

STAGING_ALIGN = 4096
SWAP_IN_SLOTS = 2


@dataclass
class _Region:
    offset: int
    nbytes: int
    released_after: torch.cuda.Event | None = None  # None while held


class StagingArena:
    """Pinned host memory for swap staging, pinned once at start-up.

    Pinned on demand, as torch's caching host allocator does whenever no cached buffer of a size class is free,
    staging costs its pinning (~1 GB/s) inside the iteration that swaps: the first swaps of each new size stalled
    serving by up to ~0.5 s. Regions are handed out first-fit and come back when released, or once the event they
    were released with has completed (a swap-in's copy up). `pin` is False only where there is no CUDA (tests)."""

    def __init__(self, nbytes: int, pin: bool = True) -> None:
        check_host_memory(
            nbytes, "swap staging (pinned, two requests of max_model_len)", "lower max_model_len or cpu_kv_cache_gb"
        )
        start = time.monotonic()
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        log.info("swap staging: %.2f GiB pinned in %.1fs", nbytes / 2**30, time.monotonic() - start)
        self._regions: list[_Region] = []  # by offset

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` in the arena, or None while no free range holds it."""
        used = math.prod(shape) * dtype.itemsize
        nbytes = -(-used // STAGING_ALIGN) * STAGING_ALIGN
        self._regions = [r for r in self._regions if r.released_after is None or not r.released_after.query()]
        start, index = 0, len(self._regions)
        for i, region in enumerate(self._regions):
            if region.offset - start >= nbytes:
                index = i
                break
            start = region.offset + region.nbytes
        if index == len(self._regions) and self.buffer.numel() - start < nbytes:
            return None
        self._regions.insert(index, _Region(start, nbytes))
        return self.buffer[start : start + used].view(dtype).view(shape)

    def release(self, tensor: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """Give `tensor`'s region back: now, or once `after` has completed."""
        offset = tensor.data_ptr() - self.buffer.data_ptr()
        region = next(r for r in self._regions if r.offset == offset)
        if after is None:
            self._regions.remove(region)
        else:
            region.released_after = after


@dataclass
class _PendingSwapOut:
    request_id: str
    host_blocks: torch.Tensor
    staging: torch.Tensor  # [layers, 2, n, block_size, Hkv, D] on the host
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
        staging_blocks: int,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`kernels`: the host-side block copies' library and team; `staging_blocks`: the pinned staging's size in
        blocks (every layer's K and V), at least the largest swap; `stream`: where the copies run on CUDA (default:
        a new stream)."""
        self.device_k, self.device_v, self.host = device_k, device_v, host
        self.device = device
        self.kernels = kernels
        self.stream = stream or (torch.cuda.Stream(device) if device.type == "cuda" else None)
        self.arena: StagingArena | None = None
        if self.stream is not None:
            block = host.k_caches[0][0]
            self.arena = StagingArena(2 * len(device_k) * staging_blocks * block.numel() * block.element_size())
        self._pending: list[_PendingSwapOut] = []
        self._swap_in_done: torch.cuda.Event | None = None

    def swap_out(self, request_id: str, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Start copying device blocks to host blocks; `complete` finishes it and returns the device blocks."""
        staging = self._staging(len(device_blocks), len(self.device_k))
        with self._on_copy_stream():
            src = self._device_ids(device_blocks)
            for staged, k, v in zip(staging, self.device_k, self.device_v):
                staged.copy_(torch.stack((k.index_select(0, src), v.index_select(0, src))), non_blocking=True)
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
            if self.arena is not None:
                self.arena.release(swap.staging)
            freed += swap.release
        self._pending = still
        return freed

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks to device blocks; compute waits for it via `wait_swap_in`. The layers take turns in
        `SWAP_IN_SLOTS` staging slots, each refilled once its copy up has landed: the few slots stay in the host's
        cache, where staging for every layer went out to DRAM (a swap-in took 1.36x as long, bench/RESULTS.md)."""
        src, staged_ids = torch.tensor(host_blocks, dtype=torch.long), torch.arange(len(host_blocks))
        staging = self._staging(len(host_blocks), min(SWAP_IN_SLOTS, len(self.device_k)))
        copied: list[torch.cuda.Event | None] = [None] * len(staging)
        with self._on_copy_stream():
            dst = self._device_ids(device_blocks)
            layers = zip(self.device_k, self.device_v, self.host.k_caches, self.host.v_caches)
            for layer, (k, v, hk, hv) in enumerate(layers):
                slot = layer % len(staging)
                if copied[slot] is not None:
                    copied[slot].synchronize()
                staged = staging[slot]
                # gathered straight into pinned staging: one host copy, on the launching thread's clock
                self.kernels.copy_blocks(staged[0], staged_ids, hk, src)
                self.kernels.copy_blocks(staged[1], staged_ids, hv, src)
                up = staged.to(self.device, non_blocking=True)
                copied[slot] = self._record()
                k.index_copy_(0, dst, up[0])
                v.index_copy_(0, dst, up[1])
            self._swap_in_done = self._record()
        if self.arena is not None:
            self.arena.release(staging, after=self._swap_in_done)

    def warm_up(self, device_block: int) -> None:
        """One block to host block 0 and back, at start-up: a process's first swap loads the copies' CUDA kernels
        (75-121 ms on the H200), which would otherwise stall the first iteration that swaps."""
        if self.stream is None:
            return
        self.swap_out("warm-up", [device_block], [0])
        self.complete(wait=True)
        self.swap_in([0], [device_block])
        self.stream.synchronize()

    def wait_swap_in(self) -> None:
        """Make the compute stream wait for swap-ins started so far."""
        if self._swap_in_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._swap_in_done)
            self._swap_in_done = None

    def _staging(self, num_blocks: int, num_layers: int) -> torch.Tensor:
        """Host staging for `num_layers` layers of a swap of `num_blocks`: [num_layers, 2, num_blocks, block_size,
        Hkv, D]. Where the arena is full, swap-outs in flight land (their staging comes back) and then swap-ins'
        copies up finish."""
        shape = (num_layers, 2, num_blocks, *self.host.k_caches[0].shape[1:])
        dtype = self.host.k_caches[0].dtype
        if self.arena is None:
            return torch.empty(shape, dtype=dtype)
        staged = self.arena.take(shape, dtype)
        if staged is None:
            self.complete(wait=True)
            self.stream.synchronize()
            staged = self.arena.take(shape, dtype)
        if staged is None:
            raise SchedulerError(f"a swap of {num_blocks} blocks is larger than the swap staging")
        return staged

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
