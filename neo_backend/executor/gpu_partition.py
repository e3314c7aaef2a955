"""An SM partition of the GPU (`gpu_sm_count`): one CUDA green context and the engine's streams on it.

Work is confined to the partition only when it is launched on a stream made from the green context: kernels,
copies, cuBLAS, Triton kernels and CUDA graphs captured on such a stream stay inside it, while anything on an
ordinary stream (a graph captured on one too) runs on every SM. So the engine's runner launches everything on
a compute stream of the partition (made current for model loading, profiling, capture and every step, on
whichever thread runs them) and swaps on a second one.

A green context destroyed while tensors, graphs or events made on its streams still exist aborts the process
(also at interpreter exit, where nothing orders the teardown), so each context is made once per process and
SM count (`sm_partition`) and never destroyed.

Limits: memory is not partitioned (pair the knob with `num_gpu_blocks` or `gpu_memory_utilization`), and the
partition is the device's first N SMs (torch's `GreenContext.create` takes a count, not a set), so engines in
one or several processes asking for N SMs share the same N: the knob caps what an engine may use, it does not
give two engines disjoint SMs.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from ..errors import ConfigError

log = logging.getLogger("neo_backend")

HOPPER_SM_GRANULARITY = 8  # compute capability 9.x partitions in multiples of 8 SMs


class SmPartition:
    def __init__(self, num_sms: int, device: torch.device) -> None:
        check_partition(num_sms, device)
        self.num_sms = num_sms
        from torch.cuda.green_contexts import GreenContext

        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.empty(1, device=device)  # the primary context, which the green context is made beside
        try:
            self.context = GreenContext.create(num_sms=num_sms, device_id=index)
        except RuntimeError as exc:
            raise ConfigError(f"gpu_sm_count={num_sms}: the driver could not create the partition ({exc})") from None
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.context))  # never destroyed, not even at exit
        log.info(
            "GPU partition: %d of %d SMs (a green context; every GPU operation runs on its streams)",
            num_sms,
            torch.cuda.get_device_properties(index).multi_processor_count,
        )

    def stream(self) -> torch.cuda.Stream:
        """A stream whose work runs on the partition's SMs (the context hands out its pool in turn)."""
        stream = self.context.Stream()
        _STREAM_SMS[stream.cuda_stream] = self.num_sms
        return stream


_PARTITIONS: dict[tuple[int, int], SmPartition] = {}
_STREAM_SMS: dict[int, int] = {}  # CUDA stream handle -> SMs of the partition it runs on


def current_sm_count(device: torch.device) -> int:
    """The SMs that work launched now runs on: the partition's, on a partition's stream; else the device's."""
    stream = torch.cuda.current_stream(device).cuda_stream
    return _STREAM_SMS.get(stream) or _device_sm_count(
        torch.cuda.current_device() if device.index is None else device.index
    )


@functools.cache
def _device_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_partition(num_sms: int, device: torch.device) -> SmPartition:
    """The process's partition of `num_sms` SMs on `device`, made on first use."""
    key = (device.index if device.index is not None else -1, num_sms)
    if key not in _PARTITIONS:
        _PARTITIONS[key] = SmPartition(num_sms, device)
    return _PARTITIONS[key]


def check_partition(num_sms: int, device: torch.device) -> None:
    """Raise ConfigError where `num_sms` cannot partition `device`."""
    if device.type != "cuda":
        raise ConfigError(
            f"gpu_sm_count={num_sms} needs a CUDA device, but the engine runs on {device.type}; unset gpu_sm_count"
        )
    from torch.cuda import green_contexts

    if not getattr(green_contexts, "SUPPORTED", False):
        raise ConfigError(
            f"gpu_sm_count needs CUDA green contexts, which this torch {torch.__version__} was built "
            f"without; use a CUDA build of torch >= 2.10 or unset gpu_sm_count"
        )
    props = torch.cuda.get_device_properties(device)
    if num_sms > props.multi_processor_count:
        raise ConfigError(f"gpu_sm_count={num_sms} exceeds the {props.multi_processor_count} SMs of {props.name}")
    if props.major >= 9 and num_sms % HOPPER_SM_GRANULARITY:
        raise ConfigError(
            f"gpu_sm_count={num_sms}: {props.name} partitions in multiples of {HOPPER_SM_GRANULARITY} SMs"
        )
