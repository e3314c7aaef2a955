"""The pipeline's hand-off between the launching thread (and the device it feeds) and the CPU-attention thread.

Per layer, the device sets a sub-batch's "ready" flag once that layer's q/k/v are in host memory, the
CPU-attention loop (`Kernels.decode_iteration`) sets a "done" flag once its output is, and the launching thread
waits on it before launching the work that consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KernelError, KernelInputError
from . import library
from .abi import FLAG_FAILED, WaitStatus

# How long a hand-off waiter spins before it polls: through any wait of an iteration. Only for waiters with a
# core of their own (on CUDA the attention team leaves one to the launching thread); others use 0.
HAND_OFF_SPIN_S = 0.1


def spin_seconds(device: torch.device) -> float:
    """How long a hand-off waiter spins: on CUDA the launching thread and the CPU-attention thread each have a core
    of their own and spin; on a CPU device they share the cores with the "device" work and poll."""
    return HAND_OFF_SPIN_S if device.type == "cuda" else 0.0


class Flags:
    """Counters in host memory that one side sets and another waits on, spinning in C with the GIL released.

    The device sets a "ready" flag from its stream behind the q/k/v it announces (hence pinned memory). A spinning
    waiter sees a store at once, where a condition variable's wake-up costs tens of microseconds per layer.
    Waiters spin for `spin_s`, then poll every 20 us (spin only where the waiter has a core of its own). A
    negative value means the setter gave up; `wait` reports it instead of waiting on.
    """

    FAILED = FLAG_FAILED

    def __init__(self, size: int, spin_s: float, pin: bool = False) -> None:
        self.spin_s, self.pin = spin_s, pin
        self._lib = library.default()
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.tensor = torch.zeros(size, dtype=torch.int64, pin_memory=self.pin)
        self.values = self.tensor.numpy()
        self.size = size

    def reset(self, size: int) -> None:
        if self.values.size < size:
            self._allocate(size)
        else:
            self.values[:size] = 0
        self.size = size

    def set(self, index: int) -> None:
        self.values[index] = 1

    def fail_from(self, index: int) -> None:
        self.values[index:] = self.FAILED

    def fail_pending(self) -> None:
        """Marks every flag of the current round not yet set as failed."""
        pending = self.values[: self.size]
        pending[pending == 0] = self.FAILED

    def address(self, index: int = 0) -> int:
        return self.values.ctypes.data + 8 * index

    def wait(self, index: int, timeout_s: float) -> bool:
        """True once flag `index` is set; False if it was marked failed. Raises KernelError on timeout."""
        if not 0 <= index < self.values.size:
            raise KernelInputError(f"flag index {index} outside [0, {self.values.size})")
        status = self._lib.neo_wait_flag(self.address(index), 1, self.spin_s, float(timeout_s))
        if status == WaitStatus.TIMED_OUT:
            raise KernelError(f"CPU attention hand-off timed out after {timeout_s:.0f} s")
        return status == WaitStatus.SET


@dataclass
class IterationLane:
    """One sub-batch's CPU decodes in a pipelined iteration: the same host buffers serve every layer (each
    layer's q/k/v are written there before its `ready` flag is set), and `ready` holds one flag per layer."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor
    ready: Flags
