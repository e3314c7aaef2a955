"""The captured decode graphs' GEMMs on the faster of cuBLAS and cuBLASLt, per weight shape and batch size.

At decode batch sizes a GEMM streams its weight once, and which library's kernel streams it faster depends on the
shape and the number of rows: on an H200 at 64 rows cuBLASLt runs the FFN's down projection ~11% and its gate/up
~4% faster than cuBLAS, and cuBLAS is as fast or faster at other shapes and sizes (bench/RESULTS.md). A graph keeps
the kernels it captured, so the choice is made per batch size, the first time a graph of that size is captured,
by timing both libraries on the layers' own weights on the engine's stream (an SM partition chooses for itself).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from ..layers.blas import LIBRARIES, Linear, preferred_library
from ..timing import median_seconds
from .cuda_graphs import capture

log = logging.getLogger("neo_backend")

# cuBLASLt is taken only when faster than cuBLAS by more than this: below it the two are within timing noise.
MARGIN = 0.02
# Weights cycled through in a timing, so the GEMMs read them from memory as a step does, not from L2.
TIMED_WEIGHTS = 8


class GemmLibraries:
    def __init__(self, model: torch.nn.Module) -> None:
        self.by_shape: dict[tuple[int, int], list[Linear]] = {}  # (in, out) features -> the layers' linears
        for module in model.layers.modules():
            if isinstance(module, Linear):
                self.by_shape.setdefault((module.in_features, module.out_features), []).append(module)
        self.chosen: dict[int, dict[tuple[int, int], str]] = {}  # rows -> shape -> library

    @contextlib.contextmanager
    def applied(self, rows: int) -> Iterator[None]:
        """Inside: every linear of the layers runs on its shape's library for `rows`-row inputs."""
        if rows not in self.chosen:
            self.chosen[rows] = {shape: self._faster(shape, rows) for shape in self.by_shape}
        for shape, library in self.chosen[rows].items():
            for linear in self.by_shape[shape]:
                linear.library = library
        try:
            yield
        finally:
            for linears in self.by_shape.values():
                for linear in linears:
                    linear.library = None

    def _faster(self, shape: tuple[int, int], rows: int) -> str:
        linears = self.by_shape[shape]
        weights = [linear.weight for linear in linears[:TIMED_WEIGHTS]]
        x = torch.randn(rows, shape[0], dtype=weights[0].dtype, device=weights[0].device)
        seconds = {}
        for library in LIBRARIES:
            with preferred_library(library):
                graph, _ = capture(lambda: [torch.nn.functional.linear(x, w) for w in weights * 2], None)
            seconds[library] = median_seconds(graph.replay, 5, device=x.device, warmup=1)
            del graph
        cublas, cublaslt = seconds.values()
        return "cublaslt" if cublaslt < (1 - MARGIN) * cublas else "cublas"

    def summary(self) -> str:
        """Which shapes run on cuBLASLt at which batch sizes ("cuBLAS everywhere" when none)."""
        lt = {
            shape: [rows for rows, chosen in sorted(self.chosen.items()) if chosen[shape] == "cublaslt"]
            for shape in self.by_shape
        }
        parts = [f"{k}x{n} at rows {', '.join(map(str, rows))}" for (k, n), rows in lt.items() if rows]
        return "cuBLASLt for " + "; ".join(parts) if parts else "cuBLAS everywhere"
