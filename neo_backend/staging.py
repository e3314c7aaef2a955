"""Host-to-device copies that do not wait for the device.

From pageable memory a CUDA copy first waits for the stream to drain, so a step's inputs copied that way stall
the host until the step before has run, and the device then idles while the host launches the rest (overlapped
steps lose their overlap). From pinned memory the copy is only queued behind the work before it.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, staged through pinned memory on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)
