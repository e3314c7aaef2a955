"""Wall-clock timing for the start-up profile and the benchmarks: the median of repeated calls, which a noisy shared
machine calls for."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    call: Callable[[], object], reps: int = 5, *, device: torch.device | None = None, warmup: int = 0
) -> float:
    """Median seconds of `reps` calls after `warmup` untimed ones; with a `device`, each waits for its work there."""
    for _ in range(warmup):
        call()
    if device is not None:
        sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        if device is not None:
            sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
