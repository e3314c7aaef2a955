"""Linear layers whose GEMM library can be chosen per call site: cuBLAS or cuBLASLt (see executor/gemm_libraries.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

LIBRARIES = ("cublas", "cublaslt")


@contextlib.contextmanager
def preferred_library(name: str) -> Iterator[None]:
    """Inside: torch's GEMMs run on BLAS library `name` (one of LIBRARIES)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class Linear(nn.Linear):
    """`nn.Linear` whose GEMM runs on `library` when it is set (None: torch's preferred library)."""

    library: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.library is None:
            return super().forward(x)
        with preferred_library(self.library):
            return super().forward(x)
