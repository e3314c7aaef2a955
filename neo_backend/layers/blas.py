"""Linear layers whose GEMM can be chosen per call site: cuBLAS, cuBLASLt or, at decode row counts, a Triton
kernel (see executor/gemm_libraries.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from . import skinny_gemm

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


@dataclass(frozen=True)
class Gemm:
    """Where a GEMM runs: BLAS library `library` (one of LIBRARIES), or the Triton kernel at `tiling` ("triton")."""

    library: str = "cublas"
    tiling: skinny_gemm.Tiling | None = None

    def __str__(self) -> str:
        return str(self.tiling) if self.tiling else {"cublas": "cuBLAS", "cublaslt": "cuBLASLt"}[self.library]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.tiling is not None:
            out = skinny_gemm.linear(x, weight, self.tiling)
            return out if bias is None else out + bias
        with preferred_library(self.library):
            return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` whose GEMM runs as `gemm` says when it is set (None: on torch's preferred library)."""

    gemm: Gemm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            return super().forward(x)
        return self.gemm.linear(x, self.weight, self.bias)
