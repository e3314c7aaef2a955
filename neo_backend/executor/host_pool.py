"""NEO's host KV pool: per-layer K/V blocks in host memory, on transparent huge pages (pinned on CUDA)."""

from __future__ import annotations

import ctypes
import logging
import math
import sys
import time
import weakref

import torch

from ..config import ModelConfig
from ..errors import ConfigError, NeoError

log = logging.getLogger("neo_backend")

HUGE_PAGE_BYTES = 2**21
MADV_HUGEPAGE = 14  # Linux
CUDA_HOST_REGISTER_PORTABLE = 1


class HostKVCache:
    """Per-layer host K/V tensors [num_blocks, block_size, Hkv, D]: views of one pool on transparent huge pages.

    The kernel reads scattered blocks, and on 4 KiB pages each 4 KiB read costs a TLB miss. With `pin` (on CUDA)
    the pool is also page-locked and registered with the driver, so swaps copy straight between it and the
    device (`swapper.py`); it stays registered while this object lives."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, pin: bool = False
    ) -> None:
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        nbytes = math.prod(shape) * dtype.itemsize
        check_host_memory(nbytes, "cpu_kv_cache_gb", "lower cpu_kv_cache_gb")
        start = time.monotonic()
        log.info("host KV pool: allocating and zeroing %.2f GiB", nbytes / 2**30)
        # Zeroed now, so its pages are in place before serving: a block's first write would otherwise fault them in
        # inside the CPU attention's timing (2 MiB zeroed per fault; far slower on a VM whose memory grows as it
        # is used), which the scheduler's fail-safe reads as a slow host (bench/RESULTS.md).
        pool = huge_page_tensor(shape, dtype).zero_()
        self.k_caches = [pool[layer, 0] for layer in range(cfg.num_layers)]
        self.v_caches = [pool[layer, 1] for layer in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        log.info(
            "host KV pool: %d blocks x %d tokens (%.2f GiB, transparent huge pages: %s) in %.1fs",
            num_blocks,
            block_size,
            nbytes / 2**30,
            transparent_huge_page_mode(),
            time.monotonic() - start,
        )
        if pin:
            start = time.monotonic()
            register_with_cuda(pool)
            weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, pool.data_ptr())
            log.info("host KV pool: pinned for the device's copies in %.1fs", time.monotonic() - start)


def register_with_cuda(tensor: torch.Tensor) -> None:
    """Page-lock a host tensor and register it with the CUDA driver for every context (the partition's too)."""
    nbytes = tensor.numel() * tensor.element_size()
    try:
        torch.cuda.check_error(
            torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
        )
    except torch.cuda.CudaError as e:
        raise ConfigError(
            f"cannot pin the host KV pool ({nbytes / 2**30:.1f} GiB) for the device's copies: {e}; lower "
            f"cpu_kv_cache_gb, or let the process lock that much memory"
        ) from e


def check_host_memory(nbytes: int, what: str, remedy: str) -> None:
    """ConfigError at start-up where `what` asks for more than 90% of the host memory available."""
    available = host_available_bytes()
    if nbytes > 0.9 * available:
        raise ConfigError(
            f"{what} asks for {nbytes / 2**30:.1f} GiB of host memory but only {available / 2**30:.1f} GiB is "
            f"available; {remedy}"
        )


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor that asks Linux for transparent huge pages before its first touch (where
    the system's THP mode is `never`, or off Linux, it gets ordinary pages). It starts on a 2 MiB boundary, so
    all of it can be huge pages and each KV block starts on a page. Left untouched, it takes memory only as
    blocks are first written, like any large allocation."""
    nbytes = math.prod(shape) * dtype.itemsize
    advised = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # whole huge pages
    raw = torch.empty(advised + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    if sys.platform == "linux" and advised:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(advised), MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def transparent_huge_page_mode() -> str:
    """The system's THP mode (`always`, `madvise` or `never`: the pool gets huge pages under the first two)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo: the host memory the KV pools may take."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as e:
        raise NeoError(
            f"cannot read /proc/meminfo ({e}); neo-triton sizes its KV pools from it and runs on Linux only"
        ) from e
    raise NeoError(
        "/proc/meminfo has no MemAvailable line (Linux 3.14 or later has one); neo-triton sizes its KV pools from it"
    )
