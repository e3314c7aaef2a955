"""An SM partition of the GPU (`gpu_sm_count`): one CUDA green context and the engine's streams on it.

Work is confined to the partition only when it is launched on a stream made from the green context: kernels,
copies, cuBLAS, Triton kernels and CUDA graphs captured on such a stream stay inside it, while anything on an
ordinary stream (a graph captured on one too) runs on every SM. So the engine launches everything on
`compute` (made current for model loading, profiling, capture and every step, on whichever thread runs them)
and swaps on `copy`, a second stream of the same context. The context must outlive every tensor and event
made on its streams, so it lives as long as the engine's runner.

Two engines (two Triton models) can share one GPU this way, each on its own SMs; memory is not partitioned.
"""
from __future__ import annotations

import contextlib
import logging
from typing import ContextManager

import torch

from .errors import ConfigError

log = logging.getLogger("neo_backend")

HOPPER_SM_GRANULARITY = 8  # compute capability 9.x partitions in multiples of 8 SMs


class SmPartition:
    def __init__(self, num_sms: int, device: torch.device) -> None:
        check_partition(num_sms, device)
        from torch.cuda.green_contexts import GreenContext

        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        try:
            self.context = GreenContext.create(num_sms=num_sms, device_id=index)
        except RuntimeError as exc:
            raise ConfigError(f"gpu_sm_count={num_sms}: the driver could not create the partition ({exc})") from None
        self.num_sms = num_sms
        self.compute = self.context.Stream()
        self.copy = self.context.Stream()
        log.info("GPU partition: %d of %d SMs (a green context; every GPU operation runs on its streams)", num_sms,
                 torch.cuda.get_device_properties(index).multi_processor_count)

    def scope(self) -> ContextManager:
        """Make the partition's compute stream current on this thread for the block."""
        return torch.cuda.stream(self.compute)


def check_partition(num_sms: int, device: torch.device) -> None:
    """Raise ConfigError where `num_sms` cannot partition `device`."""
    if device.type != "cuda":
        raise ConfigError(f"gpu_sm_count={num_sms} needs a CUDA device, but the engine runs on {device.type}; "
                          f"unset gpu_sm_count")
    from torch.cuda import green_contexts

    if not getattr(green_contexts, "SUPPORTED", False):
        raise ConfigError(f"gpu_sm_count needs CUDA green contexts, which this torch {torch.__version__} was built "
                          f"without; use a CUDA build of torch >= 2.10 or unset gpu_sm_count")
    props = torch.cuda.get_device_properties(device)
    if num_sms > props.multi_processor_count:
        raise ConfigError(f"gpu_sm_count={num_sms} exceeds the {props.multi_processor_count} SMs of {props.name}")
    if props.major >= 9 and num_sms % HOPPER_SM_GRANULARITY:
        raise ConfigError(f"gpu_sm_count={num_sms}: {props.name} partitions in multiples of "
                          f"{HOPPER_SM_GRANULARITY} SMs")


def device_scope(partition: SmPartition | None) -> ContextManager:
    return partition.scope() if partition is not None else contextlib.nullcontext()
