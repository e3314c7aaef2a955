"""Device-side waits on host flags: a CUDA stream holds its next work until an int64 in pinned host memory is set.

The pipeline's launching thread queues every layer's segment at once, each behind a wait on the CPU attention's
done flag of the layer before (pipeline.py). Waiting on the host instead, the thread launched a segment only after
the flag came, so the device idled through the thread's wake-up and the launch in every layer (~0.5 ms of a
sequential iteration at 8 SMs, bench/RESULTS.md). The wait is a CUDA stream memory operation
(`cuStreamWaitValue64`, driver API): the device polls the flag itself.

It waits for the flag's lowest bit: 1 (set) and -1 (`Flags.FAILED`: the host gave up) both release it, so a
failed iteration never leaves the device waiting.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger("neo_backend")

CUDA_SUCCESS = 0
CU_STREAM_WAIT_VALUE_AND = 0x2  # wait until (*addr & value) != 0


@functools.cache
def _wait_value64() -> Callable[..., int] | None:
    """cuStreamWaitValue64 from the driver, or None where the driver or the device lacks it."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWaitValue64_v2", "cuStreamWaitValue64"):
        fn = getattr(driver, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def enqueue_wait(stream: torch.cuda.Stream, address: int) -> None:
    """Work queued on `stream` after this runs once the int64 at `address` (pinned host memory, which a device
    with unified addressing reads at the same address) has its lowest bit set."""
    status = _wait_value64()(stream.cuda_stream, address, 1, CU_STREAM_WAIT_VALUE_AND)
    if status != CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWaitValue64 failed with CUDA driver error {status}")


def available(device: torch.device) -> bool:
    """Whether streams on `device` can wait on host flags: the driver has the call and it works on a set flag."""
    if device.type != "cuda" or _wait_value64() is None:
        return False
    flag = torch.ones(1, dtype=torch.int64, pin_memory=True)
    try:
        enqueue_wait(torch.cuda.current_stream(device), flag.data_ptr())
        torch.cuda.current_stream(device).synchronize()
    except RuntimeError as err:
        log.info("pipeline hand-offs: the launching thread waits for each layer's CPU attention (%s)", err)
        return False
    log.info("pipeline hand-offs: the device waits for each layer's CPU attention itself")
    return True
