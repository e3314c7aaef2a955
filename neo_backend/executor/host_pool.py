"""NEO's host KV pool: per-layer K/V blocks in host memory, on transparent huge pages."""

from __future__ import annotations

import ctypes
import logging
import math
import sys
import time

import torch

from ..config import ModelConfig
from ..errors import ConfigError, NeoError

log = logging.getLogger("neo_backend")

HUGE_PAGE_BYTES = 2**21
MADV_HUGEPAGE = 14  # Linux


class HostKVCache:
    """Per-layer host K/V tensors [num_blocks, block_size, Hkv, D] on transparent huge pages.

    Only the CPU touches the pool (swaps go through pinned staging buffers), so it needs no pinning; huge pages
    matter more: the kernel reads scattered blocks, and on 4 KiB pages each 4 KiB read costs a TLB miss."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        nbytes = 2 * cfg.num_layers * num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        check_host_memory(nbytes, "cpu_kv_cache_gb", "lower cpu_kv_cache_gb")
        start = time.monotonic()
        log.info("host KV pool: allocating and zeroing %.2f GiB", nbytes / 2**30)
        # Zeroed now, so its pages are in place before serving: a block's first write would otherwise fault them in
        # inside the CPU attention's timing (2 MiB zeroed per fault; far slower on a VM whose memory grows as it
        # is used), which the scheduler's fail-safe reads as a slow host (bench/RESULTS.md).
        self.k_caches = [huge_page_tensor(shape, dtype).zero_() for _ in range(cfg.num_layers)]
        self.v_caches = [huge_page_tensor(shape, dtype).zero_() for _ in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        log.info(
            "host KV pool: %d blocks x %d tokens (%.2f GiB, transparent huge pages: %s) in %.1fs",
            num_blocks,
            block_size,
            nbytes / 2**30,
            transparent_huge_page_mode(),
            time.monotonic() - start,
        )


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
