"""Block swaps between the device KV pool and the host KV pool.

On CUDA the host pool is pinned (`HostKVCache`), so a swap is copies between the two pools and nothing else: no
staging buffer and no work for the host's cores, which the CPU attention needs. Swaps run on their own stream.
A swap-out gathers each layer's device blocks into a device buffer and copies it down, one copy per run of
consecutive host blocks (`BlockManager` hands a request's host blocks out in runs); a swap-in copies the runs up
into a device buffer and scatters it into the device blocks. The compute stream waits for a swap on the device,
never the launching thread: a step that reuses a swap-out's device blocks, or reads a swap-in's, starts once the
copies are done, and the launching thread queues it meanwhile (once `warm_up` has loaded the copies' kernels:
loading one waits for the work queued on the device). Whatever the host reads of a swapped request, it reads
after the step's own device work has run (the pipeline's hand-offs), so after the copies too.
Without CUDA the same copies run at once on the calling thread.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .host_pool import HostKVCache


@dataclass
class _PendingSwapOut:
    request_id: str
    done: torch.cuda.Event | None
    release: list[int]  # device blocks to free once the copies have landed


def block_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(position in `blocks`, first block, length) of each run of consecutive ids in `blocks`."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == block:
            offset, first, length = runs[-1]
            runs[-1] = (offset, first, length + 1)
        else:
            runs.append((position, block, 1))
    return runs


class BlockSwapper:
    """Copies KV blocks between the device pool (`device_k`/`device_v`, per layer) and the host pool."""

    def __init__(
        self,
        device_k: list[torch.Tensor],
        device_v: list[torch.Tensor],
        host: HostKVCache,
        device: torch.device,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`stream`: where the copies run on CUDA (default: a new stream)."""
        self.device_k, self.device_v, self.host = device_k, device_v, host
        self.device = device
        self.stream = stream or (torch.cuda.Stream(device) if device.type == "cuda" else None)
        self._pending: list[_PendingSwapOut] = []
        self._swap_in_done: torch.cuda.Event | None = None

    def swap_out(self, request_id: str, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Start copying device blocks to host blocks; `complete` reports it landed and returns the device blocks."""
        runs = block_runs(host_blocks)
        with self._on_copy_stream():
            src = self._device_ids(device_blocks)
            for device_pool, host_pool in self._pools():
                gathered = device_pool.index_select(0, src)
                for offset, first, length in runs:
                    host_pool[first : first + length].copy_(gathered[offset : offset + length], non_blocking=True)
            done = self._record()
        self._pending.append(_PendingSwapOut(request_id, done, list(device_blocks)))

    def in_transit(self, request_id: str) -> bool:
        return any(swap.request_id == request_id for swap in self._pending)

    def complete(self, wait: bool = True, only: list[str] | None = None) -> list[int]:
        """Land started swap-outs: every one (`wait`), only those whose copies have already finished (a freshly
        prefilled request moves to the host pool while the device computes), or those of the requests in
        `only` (what another rank landed). Returns the device blocks now free. The compute stream waits for the
        copies of those landed unfinished, so what it runs next, and what the host reads after that, sees them."""
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
                swap.done.wait(self._compute_stream())
            freed += swap.release
        self._pending = still
        return freed

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks up to device blocks; the compute stream waits for it (`wait_swap_in`)."""
        runs = block_runs(host_blocks)
        with self._on_copy_stream():
            dst = self._device_ids(device_blocks)
            for device_pool, host_pool in self._pools():
                arrived = torch.empty(
                    (len(host_blocks), *device_pool.shape[1:]), dtype=device_pool.dtype, device=self.device
                )
                for offset, first, length in runs:
                    arrived[offset : offset + length].copy_(host_pool[first : first + length], non_blocking=True)
                device_pool.index_copy_(0, dst, arrived)
            self._swap_in_done = self._record()

    def warm_up(self, device_block: int) -> None:
        """Swaps of one device block to host block 0 and back at start-up, naming it once and 17 times: the gather
        picks one kernel for up to 16 ids and another past that, and a process's first launch of each loads it
        (75-121 ms on the H200), waiting for the work queued on the device. Without this, a swap's launch would
        hold the scheduling thread behind earlier swaps' copies."""
        if self.stream is None:
            return
        for count in (1, 17):
            self.swap_out("warm-up", [device_block] * count, [0] * count)
            self.complete(wait=True)
            self.swap_in([0] * count, [device_block] * count)
            self.wait_swap_in()
        torch.cuda.synchronize(self.device)

    def wait_swap_in(self) -> None:
        """Make the compute stream wait for swap-ins started so far."""
        if self._swap_in_done is not None:
            self._swap_in_done.wait(self._compute_stream())
            self._swap_in_done = None

    def _compute_stream(self) -> torch.cuda.Stream | None:
        """The calling thread's current stream: the engine's compute stream within its device scope."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _pools(self):
        """(device, host) K and V pools of every layer."""
        for k, v, host_k, host_v in zip(self.device_k, self.device_v, self.host.k_caches, self.host.v_caches):
            yield k, host_k
            yield v, host_v

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
