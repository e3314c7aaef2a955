"""The device's side of the pipeline's host flags: a CUDA stream sets an int64 in pinned host memory behind the
work queued before it, or holds its next work until the host sets one.

The pipeline's launching thread queues every layer's segment at once (pipeline.py): each segment sets its lane's
ready flag once that layer's q/k/v are in host memory (`enqueue_set`), and the next waits on the CPU attention's
done flag of the layer before (`enqueue_wait`). Waiting on the host instead, the thread launched a segment only
after the flag came, so the device idled through the thread's wake-up and the launch in every layer (~0.5 ms of
a sequential iteration at 8 SMs, bench/RESULTS.md). Both are CUDA stream memory operations (driver API): the
device's front end writes or polls the flag itself, with no kernel and no copy engine involved.

A wait is released by the flag's lowest bit: 1 (set) and -1 (`Flags.FAILED`: the host gave up) both release it,
so a failed iteration never leaves the device waiting.
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
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # the write lands after every write of the work queued before it


@functools.cache
def _driver_call(name: str) -> Callable[..., int] | None:
    """cuStream{Wait,Write}Value64 from the driver, or None where the driver lacks it."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for symbol in (f"{name}_v2", name):
        fn = getattr(driver, symbol, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def _call(name: str, stream: torch.cuda.Stream, address: int, value: int, flags: int) -> None:
    status = _driver_call(name)(stream.cuda_stream, address, value, flags)
    if status != CUDA_SUCCESS:
        raise RuntimeError(f"{name} failed with CUDA driver error {status}")


def enqueue_wait(stream: torch.cuda.Stream, address: int) -> None:
    """Work queued on `stream` after this runs once the int64 at `address` (pinned host memory, which a device
    with unified addressing reaches at the same address) has its lowest bit set."""
    _call("cuStreamWaitValue64", stream, address, 1, CU_STREAM_WAIT_VALUE_AND)


def enqueue_set(stream: torch.cuda.Stream, address: int) -> None:
    """Sets the int64 at `address` (pinned host memory) to 1 once the work queued on `stream` before it is done,
    its writes to host memory visible first."""
    _call("cuStreamWriteValue64", stream, address, 1, CU_STREAM_WRITE_VALUE_DEFAULT)


def available(device: torch.device) -> bool:
    """Whether streams on `device` can set and wait on host flags: the driver has both calls and they work."""
    if device.type != "cuda" or None in (_driver_call("cuStreamWaitValue64"), _driver_call("cuStreamWriteValue64")):
        return False
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream(device)
    try:
        enqueue_set(stream, flag.data_ptr())
        enqueue_wait(stream, flag.data_ptr())
        stream.synchronize()
    except RuntimeError as err:
        log.warning("CUDA stream memory operations do not work here (%s)", err)
        return False
    return int(flag[0]) == 1
