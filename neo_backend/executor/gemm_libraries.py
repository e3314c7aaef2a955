"""The captured decode graphs' GEMMs on the fastest of cuBLAS, cuBLASLt and a Triton kernel, per weight shape and
batch size.

At decode batch sizes a GEMM streams its weight once, and which kernel streams it fastest depends on the shape and
the number of rows: on an H200 at 64 rows cuBLASLt runs the FFN's down projection ~11% and its gate/up ~4% faster
than cuBLAS, and on an H100 the Triton kernel (`layers/skinny_gemm.py`) beats both for gate/up up to 64 rows and
for o and down at a few (bench/RESULTS.md). A graph keeps the kernels it captured, so the choice is made per batch
size, the first time a graph of that size is captured, by timing the candidates on the layers' own weights on the
engine's stream (an SM partition chooses for itself).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from ..layers import skinny_gemm
from ..layers.blas import LIBRARIES, Gemm, Linear
from ..timing import median_seconds
from .cuda_graphs import capture
from .gpu_partition import current_sm_count

log = logging.getLogger("neo_backend")

# Another GEMM is taken over cuBLAS only when faster by more than this: below it the two are within timing noise.
MARGIN = 0.02
# Weights cycled through in a timing, so the GEMMs read them from memory as a step does, not from L2.
TIMED_WEIGHTS = 8


class GemmLibraries:
    def __init__(self, model: torch.nn.Module) -> None:
        self.by_shape: dict[tuple[int, int], list[Linear]] = {}  # (in, out) features -> the layers' linears
        for module in model.layers.modules():
            if isinstance(module, Linear):
                self.by_shape.setdefault((module.in_features, module.out_features), []).append(module)
        self.chosen: dict[int, dict[tuple[int, int], Gemm]] = {}  # rows -> shape -> where its GEMM runs

    @contextlib.contextmanager
    def applied(self, rows: int) -> Iterator[None]:
        """Inside: every linear of the layers runs its GEMM where its shape's is fastest for `rows`-row inputs."""
        if rows not in self.chosen:
            self.chosen[rows] = {shape: self._fastest(shape, rows) for shape in self.by_shape}
        for shape, gemm in self.chosen[rows].items():
            for linear in self.by_shape[shape]:
                linear.gemm = gemm
        try:
            yield
        finally:
            for linears in self.by_shape.values():
                for linear in linears:
                    linear.gemm = None

    def candidates(self, shape: tuple[int, int], rows: int, device: torch.device) -> list[Gemm]:
        """cuBLAS first (the baseline), cuBLASLt, and the Triton tilings for 16-bit layers of few rows."""
        gemms = [Gemm(library) for library in LIBRARIES]
        if self.by_shape[shape][0].weight.dtype in skinny_gemm.DTYPES:
            tilings = skinny_gemm.tilings(rows, *shape, current_sm_count(device))
            gemms += [Gemm("triton", tiling) for tiling in tilings]
        return gemms

    def _fastest(self, shape: tuple[int, int], rows: int) -> Gemm:
        timed = self.by_shape[shape][:TIMED_WEIGHTS]
        weight = timed[0].weight
        x = torch.randn(rows, shape[0], dtype=weight.dtype, device=weight.device)
        seconds = {}
        for gemm in self.candidates(shape, rows, x.device):
            graph, _ = capture(lambda gemm=gemm: [gemm.linear(x, lin.weight, lin.bias) for lin in timed * 2], None)
            seconds[gemm] = median_seconds(graph.replay, 5, device=x.device, warmup=1)
            del graph
        baseline = Gemm("cublas")
        fastest = min(seconds, key=seconds.get)
        return fastest if seconds[fastest] < (1 - MARGIN) * seconds[baseline] else baseline

    def summary(self) -> str:
        """Which shapes run off cuBLAS, where, at which batch sizes ("cuBLAS everywhere" when none)."""
        parts = []
        for shape in self.by_shape:
            rows_by_gemm: dict[str, list[int]] = {}
            for rows, chosen in sorted(self.chosen.items()):
                if chosen[shape] != Gemm("cublas"):
                    rows_by_gemm.setdefault(str(chosen[shape]), []).append(rows)
            where = [f"{gemm} at rows {', '.join(map(str, rows))}" for gemm, rows in rows_by_gemm.items()]
            if where:
                parts.append(f"{shape[0]}x{shape[1]}: {'; '.join(where)}")
        return " | ".join(parts) if parts else "cuBLAS everywhere"
