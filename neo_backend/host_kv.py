"""NEO's host side of the KV cache: the host pool, block swaps between pools, and CPU decode attention.

Swaps run on their own CUDA stream: a swap-out gathers the request's device blocks into a staging buffer and
copies it to pinned memory; it completes (scatter into the host pool, device blocks freed) at the start of
a later step once the copy has landed, or at once where the scheduler needs its device blocks now. A swap-in
gathers host blocks into pinned staging, copies them up and scatters them into the device pool on the copy
stream; the compute stream waits on its event before using them.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from . import cpu_attention
from .config import ModelConfig
from .cpus import attention_cpus, pin_current_thread
from .errors import ConfigError

log = logging.getLogger("neo_backend")


class HostKVCache:
    """Per-layer host K/V tensors [num_blocks, block_size, Hkv, D] on transparent huge pages.

    Only the CPU touches the pool (swaps go through pinned staging buffers), so it needs no pinning; huge pages
    matter more: the kernel reads scattered blocks, and on 4 KiB pages each 4 KiB read costs a TLB miss."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        nbytes = 2 * cfg.num_layers * num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        available = host_available_bytes()
        if nbytes > 0.9 * available:
            raise ConfigError(f"cpu_kv_cache_gb asks for {nbytes / 2**30:.1f} GiB of host memory but only "
                              f"{available / 2**30:.1f} GiB is available; lower cpu_kv_cache_gb")
        start = time.monotonic()
        # Left uninitialized: the kernel reads only slots below a context length, all written before.
        self.k_caches = [huge_page_tensor(shape, dtype) for _ in range(cfg.num_layers)]
        self.v_caches = [huge_page_tensor(shape, dtype) for _ in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        log.info("host KV pool: %d blocks x %d tokens (%.2f GiB, transparent huge pages: %s) in %.1fs", num_blocks,
                 block_size, nbytes / 2 ** 30, transparent_huge_page_mode(), time.monotonic() - start)


HUGE_PAGE_BYTES = 2 ** 21
MADV_HUGEPAGE = 14   # Linux


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor that asks Linux for transparent huge pages before its first touch (where
    the system's THP mode is `never`, or off Linux, it gets ordinary pages). It starts on a 2 MiB boundary, so
    all of it can be huge pages and each KV block starts on a page (the kernel read 4% faster on the Zen 4 VM
    than from torch.empty's placement, paired calls). Left untouched, it takes memory only as blocks are first
    written, like any large allocation."""
    nbytes = math.prod(shape) * dtype.itemsize
    advised = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # whole huge pages
    raw = torch.empty(advised + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    if sys.platform == "linux" and advised:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(advised), MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def transparent_huge_page_mode() -> str:
    """The system's THP mode (`always`, `madvise` or `never`: the pool gets huge pages under the first two)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


@dataclass
class _PendingSwapOut:
    request_id: str
    host_blocks: torch.Tensor
    staging: list[torch.Tensor]            # per layer: [2, n, block_size, Hkv, D] on the host
    done: torch.cuda.Event | None
    release: list[int] = field(default_factory=list)  # device blocks to free once the copy has finished


class BlockSwapper:
    def __init__(self, device_k: list[torch.Tensor], device_v: list[torch.Tensor], host: HostKVCache,
                 device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        """`stream`: where the copies run on CUDA (default: a new stream)."""
        self.device_k, self.device_v, self.host = device_k, device_v, host
        self.device = device
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
        self._pending.append(_PendingSwapOut(request_id, torch.tensor(host_blocks, dtype=torch.long), staging, done,
                                             list(device_blocks)))

    def in_transit(self, request_id: str) -> bool:
        return any(swap.request_id == request_id for swap in self._pending)

    def complete(self, wait: bool = True) -> list[int]:
        """Finish started swap-outs: every one (`wait`), or only those whose copy has already landed, so a
        freshly prefilled request moves to the host pool while the device computes. Scatters them into the
        host pool and returns the device blocks that are now free."""
        freed, still = [], []
        for swap in self._pending:
            if swap.done is not None and not wait and not swap.done.query():
                still.append(swap)
                continue
            if swap.done is not None:
                swap.done.synchronize()
            for layer, staged in enumerate(swap.staging):
                self.host.k_caches[layer].index_copy_(0, swap.host_blocks, staged[0])
                self.host.v_caches[layer].index_copy_(0, swap.host_blocks, staged[1])
            freed += swap.release
        self._pending = still
        return freed

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks to device blocks; compute waits for it via `wait_swap_in`."""
        src = torch.tensor(host_blocks, dtype=torch.long)
        with self._on_copy_stream():
            dst = self._device_ids(device_blocks)
            for k, v, hk, hv in zip(self.device_k, self.device_v, self.host.k_caches, self.host.v_caches):
                # gathered straight into pinned staging: one host copy, on the launching thread's clock
                staged = torch.empty((2, len(host_blocks), *hk.shape[1:]), dtype=hk.dtype,
                                     pin_memory=self.stream is not None)
                torch.index_select(hk, 0, src, out=staged[0])
                torch.index_select(hv, 0, src, out=staged[1])
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
        return torch.tensor(ids, dtype=torch.long, pin_memory=self.stream is not None).to(self.device,
                                                                                          non_blocking=True)

    def _record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


@dataclass
class HostDecodeBatch:
    """The CPU-requests of one (sub-)batch: where their new k/v go and what they attend to."""
    block_tables: torch.Tensor   # int32 [B, max_blocks]
    context_lens: torch.Tensor   # int32 [B]
    slots: torch.Tensor          # int64 [B]

    @property
    def size(self) -> int:
        return self.context_lens.numel()

    @property
    def context_tokens(self) -> int:
        return int(self.context_lens.sum())


class HostAttention:
    """Decode attention of CPU-requests: q/k/v of the new token go down, the kernel appends k/v to the host
    pool and attends (GIL released), the output goes back up. Times every call for the fail-safe."""

    def __init__(self, host: HostKVCache, scale: float, device: torch.device, num_threads: int | None,
                 engine_cpu: int | None = None) -> None:
        self.host = host
        self.scale = scale
        self.device = device
        self.engine_cpu = engine_cpu
        self.cpus = attention_cpus(engine_cpu)
        if not num_threads and engine_cpu is not None:
            num_threads = len(self.cpus)
        elif not num_threads and device.type == "cuda":
            # one core stays with the thread that launches the device work: OpenMP's static schedule waits
            # for its slowest thread, and a team on every core shares one with that thread
            num_threads = max(1, len(self.cpus) - 1)
        if num_threads:
            cpu_attention.set_num_threads(num_threads)
        self.seconds = 0.0

    def enter_thread(self) -> None:
        """Run first by a thread that will call the kernels: with `engine_cpu` set, it and the OpenMP team it
        starts (whose threads inherit its CPUs) stay off the engine's CPU. A one-token call starts that team
        now rather than inside the first iteration, whose timing the fail-safe reads."""
        if self.engine_cpu is not None:
            pin_current_thread(self.cpus, "CPU attention")
        k_cache, v_cache = self.host.k_caches[0], self.host.v_caches[0]
        q = torch.zeros(1, *k_cache.shape[2:], dtype=k_cache.dtype)
        one = torch.ones(1, 1, dtype=torch.int32)
        cpu_attention.paged_decode_attention(q, k_cache, v_cache, one - 1, one[0], self.scale)

    def run(self, layer: int, batch: HostDecodeBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor) -> None:
        """q [B, Hq, D], k/v [B, Hkv, D] on the host (already copied down) -> attention output into `out`."""
        start = time.perf_counter()
        cpu_attention.append_kv(k, v, self.host.k_caches[layer], self.host.v_caches[layer], batch.slots)
        cpu_attention.paged_decode_attention(q, self.host.k_caches[layer], self.host.v_caches[layer],
                                             batch.block_tables, batch.context_lens, self.scale, out=out)
        self.seconds += time.perf_counter() - start

    def run_iteration(self, lanes: list[cpu_attention.IterationLane], done: cpu_attention.Flags,
                      timeout_s: float) -> None:
        """Every layer of a pipelined iteration, each step once its lane's ready flag is set (see
        `cpu_attention.decode_iteration`)."""
        seconds = cpu_attention.decode_iteration(self.host.k_caches, self.host.v_caches, lanes, done, self.scale,
                                                 timeout_s)
        self.seconds += float(seconds.sum())


def host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
