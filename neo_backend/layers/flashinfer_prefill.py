"""Causal prefill attention through FlashInfer's ragged prefill on Hopper GPUs, where the optional
`flashinfer-python` package is installed (`pip install .[flashinfer]`).

On an H100 its FlashAttention-3 kernels attend 8 x 1000-token prompts in 157 µs a layer against 322 µs for torch's
flash attention (FA2) variable-length call, and 3 x 7000 tokens 1.9x faster (bench/RESULTS.md). Its decode kernels
were slower than ours at every batch measured, so decode stays on `paged_decode`. FlashInfer compiles its kernels
with nvcc at first use (the engine's first prefill, at start-up); where it is not installed, the GPU is not a
Hopper or its kernels do not build, prefill keeps torch's call, and the log says which runs.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .attention import PrefillRun

log = logging.getLogger("neo_backend")

WORKSPACE_BYTES = 256 << 20  # FlashInfer's scratch, shared by a device's wrappers; 3 x 7000-token prompts fit


class RaggedPrefill:
    """FlashInfer's prefill for one device and one attention shape: a wrapper for each prefill run of a step (their
    plans differ), planned at the first layer that attends the run and run by every layer."""

    def __init__(self, flashinfer: Any, device: torch.device) -> None:
        self.flashinfer = flashinfer
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrappers: list[Any] = []
        self.planned: list[object | None] = []  # the run each wrapper is planned for

    def attend(
        self,
        index: int,
        run: PrefillRun,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """The step's `index`-th prefill run: q [T, Hq, D], k/v [keys, Hkv, D] into out [T, Hq, D], each of its
        chunks (`run.lengths` query rows, `run.key_lengths` key rows) causal from the bottom right."""
        while len(self.wrappers) <= index:
            wrapper = self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
            self.wrappers.append(wrapper)
            self.planned.append(None)
        wrapper = self.wrappers[index]
        if self.planned[index] is not run:
            wrapper.plan(
                _offsets(run.lengths),
                _offsets(run.key_lengths),
                q.shape[1],
                k.shape[1],
                q.shape[2],
                causal=True,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=k.dtype,
            )
            self.planned[index] = run
        wrapper.run(q, k, v, out=out)


def _offsets(lengths: list[int]) -> torch.Tensor:
    """Host offsets in pinned memory: `plan` reads them on the host and copies them to the device, and a copy from
    pageable memory would wait for the device to drain the step's queue."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32, pin_memory=True)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=offsets[1:])
    return offsets


_by_shape: dict[tuple, RaggedPrefill | None] = {}


def for_shape(q: torch.Tensor, k: torch.Tensor) -> RaggedPrefill | None:
    """FlashInfer's prefill for q [T, Hq, D] and k [keys, Hkv, D] on their CUDA device, or None where torch's call
    runs; decided (and logged) once a device and shape, by building the kernels on a small problem."""
    key = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
    if key not in _by_shape:
        _by_shape[key] = _load(q, k)
    return _by_shape[key]


def _load(q: torch.Tensor, k: torch.Tensor) -> RaggedPrefill | None:
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        log.info("prefill attention: torch flash attention (FlashInfer's FlashAttention-3 kernels need a Hopper GPU)")
        return None
    try:
        import flashinfer
    except ImportError:
        log.info("prefill attention: torch flash attention (FlashInfer's, 1.5-2x faster: pip install .[flashinfer])")
        return None
    log.info("prefill attention: building FlashInfer %s's kernels (nvcc, once per machine)", flashinfer.__version__)
    prefill = RaggedPrefill(flashinfer, q.device)
    rows = 16
    try:
        q_probe, k_probe, v_probe = (torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=t.device) for t in (q, k, k))
        run = SimpleNamespace(lengths=[rows], key_lengths=[rows])
        prefill.attend(0, run, q_probe, k_probe, v_probe, scale=1.0, out=torch.empty_like(q_probe))
        torch.cuda.synchronize(q.device)
    except Exception as error:  # a missing nvcc, an unsupported head size: any failure keeps torch's kernels
        log.warning("prefill attention: torch flash attention (FlashInfer's kernels did not build: %s)", error)
        return None
    log.info("prefill attention: FlashInfer %s (FlashAttention-3)", flashinfer.__version__)
    return prefill
