"""Moving data between host and device without waiting for the device.

From pageable memory a CUDA copy first waits for the stream to drain, so a step's inputs copied that way stall
the host until the step before has run, and the device then idles while the host launches the rest (overlapped
steps lose their overlap). From pinned memory the copy is only queued behind the work before it.

Small buffers that the device and the host hand each other within a step need no copy at all: the device's
kernels read and write pinned host memory in place (`device_view`, `write_rows`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, staged through pinned memory on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned, contiguous `host` memory as a tensor on CUDA `device`, for kernels that read or write it in place
    over the bus: with unified addressing a pinned buffer has one address on both sides. Elsewhere `host` itself.
    The view does not keep `host` alive."""
    if device.type != "cuda":
        return host
    if not (host.is_pinned() and host.is_contiguous()):
        raise ValueError("device_view needs pinned, contiguous host memory")
    interface = {
        "shape": (host.numel() * host.element_size(),),
        "typestr": "|u1",
        "data": (host.data_ptr(), False),
        "version": 3,
    }
    raw = torch.as_tensor(SimpleNamespace(__cuda_array_interface__=interface), device=device)
    return raw.view(host.dtype).view(host.shape)


def write_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` by a kernel, where `dst` may be a `device_view` of host memory: torch copies between
    contiguous tensors of one device with a copy-engine memcpy, which the CUDA docs leave undefined for host
    memory and which would queue the device's next kernel behind the copy engine. Multiplying by one is exact."""
    torch.mul(src, 1, out=dst)
