"""NEO's performance model: predicted iteration time by mode, profiled at start-up and corrected online.

Times are per iteration, all layers: dense work (linear/FFN/norms/logits) by the batch's tokens, interpolated
between profiled token counts (flat while the weights' read dominates, then rising with the FLOPs: no one line
fits both a decode batch and a prefill chunk on a small GPU), device decode attention by its context tokens,
host decode attention by requests and context tokens.
The host term is scaled by `cpu_correction`, an exponential average of measured over predicted host time,
so CPU contention from other processes makes the scheduler hand the CPU less work (the fail-safe); whole
iterations are watched too, and `offload_slowdown` scales every prediction that involves CPU work (`corrected`,
taken back out where such a prediction is compared with its measurement, `observe_iteration`).
"""

from __future__ import annotations

import bisect
import json
import logging
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("neo_backend")

CORRECTION_SMOOTHING = 0.3
RECOVERY = 0.02  # per iteration without CPU work, the corrections drift back toward the prediction
CPU_OUTLIER_WINDOW = 3  # the host correction follows the median of this many latest observations
_PRIOR_CPU_RATIOS = [1.0] * (CPU_OUTLIER_WINDOW - 1)  # before any: the profile's own, so a first outlier is one


@dataclass
class PerfModel:
    dense_tokens: list[int]  # profiled token counts, ascending
    dense_seconds: list[float]  # dense time at each, non-decreasing
    gpu_attn_per_token: float
    cpu_attn_fixed: float
    cpu_attn_per_request: float
    cpu_attn_per_token: float
    cpu_correction: float = 1.0  # measured / predicted host attention time (kernel calls alone)
    gpu_only_ratio: float = 1.0  # measured / predicted time of iterations without CPU work
    offload_ratio: float | None = None  # measured / predicted time of iterations with CPU work, once seen
    recent_cpu_ratios: list[float] = field(default_factory=lambda: _PRIOR_CPU_RATIOS.copy())  # latest, oldest first

    def dense(self, tokens: int) -> float:
        """Piecewise linear through the profiled points; the last segment extends beyond them."""
        if not tokens:
            return 0.0
        xs, ys = self.dense_tokens, self.dense_seconds
        if len(xs) == 1 or tokens <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def gpu_attention(self, context_tokens: int) -> float:
        return self.gpu_attn_per_token * context_tokens

    def cpu_attention(self, requests: int, context_tokens: int) -> float:
        if not requests:
            return 0.0
        raw = self.cpu_attn_fixed + self.cpu_attn_per_request * requests + self.cpu_attn_per_token * context_tokens
        return raw * self.cpu_correction

    def sequential(self, gpu_tokens: int, gpu_ctx: int, cpu_reqs: int, cpu_ctx: int) -> float:
        """One batch: in every layer the host rows' q/k/v go to the host before the device rows' attention runs,
        so the two attentions run side by side."""
        attention = max(self.gpu_attention(gpu_ctx), self.cpu_attention(cpu_reqs, cpu_ctx))
        return self.dense(gpu_tokens + cpu_reqs) + attention

    def pipelined(self, gpu_tokens: int, gpu_ctx: int, cpu0: tuple[int, int], cpu1: tuple[int, int]) -> float:
        """Sub-batch 0 = GPU work + CPU-requests cpu0, sub-batch 1 = CPU-requests cpu1 (requests, context).
        While the GPU runs one sub-batch's dense layers, the CPU runs the other's attention."""
        gpu0 = self.dense(gpu_tokens + cpu0[0]) + self.gpu_attention(gpu_ctx)
        gpu1 = self.dense(cpu1[0])
        return max(gpu0, self.cpu_attention(*cpu1)) + max(gpu1, self.cpu_attention(*cpu0))

    def iteration(self, gpu_tokens: int, gpu_ctx: int, cpu_ctx: list[int], split: int | None) -> float:
        """An iteration with CPU decodes of contexts `cpu_ctx`: sequential (`split` None), or pipelined with the
        first `split` of them in sub-batch 0."""
        if split is None:
            return self.sequential(gpu_tokens, gpu_ctx, len(cpu_ctx), sum(cpu_ctx))
        cpu0, cpu1 = cpu_ctx[:split], cpu_ctx[split:]
        return self.pipelined(gpu_tokens, gpu_ctx, (len(cpu0), sum(cpu0)), (len(cpu1), sum(cpu1)))

    @property
    def offload_slowdown(self) -> float:
        """How much worse than predicted iterations with CPU work run, relative to those without: what the
        kernel timings miss (transfers, synchronisation, launch gaps, a busy host)."""
        return 1.0 if self.offload_ratio is None else self.offload_ratio / self.gpu_only_ratio

    def corrected(self, predicted: float, with_cpu_work: bool) -> float:
        """An iteration's predicted time as serving has measured such iterations to run."""
        return predicted * self.offload_slowdown if with_cpu_work else predicted

    def reset_observations(self) -> None:
        """Back to the profile: what serving measured so far is forgotten."""
        self.cpu_correction, self.gpu_only_ratio, self.offload_ratio = 1.0, 1.0, None
        self.recent_cpu_ratios = _PRIOR_CPU_RATIOS.copy()

    def observe_cpu(self, predicted: float, measured: float) -> None:
        """One iteration's host attention, measured against `predicted` (as `cpu_attention` gave it). The correction
        moves toward the median of the latest observations: one slow iteration among normal ones (a page fault, a
        cold cache) is not a busy host, while a busy host makes every iteration slow."""
        if predicted <= 0 or measured <= 0:
            return
        self.recent_cpu_ratios = [
            *self.recent_cpu_ratios[1 - CPU_OUTLIER_WINDOW :],
            measured * self.cpu_correction / predicted,
        ]
        ratio = statistics.median(self.recent_cpu_ratios)
        self.cpu_correction += CORRECTION_SMOOTHING * (ratio - self.cpu_correction)

    def observe_iteration(self, predicted: float, measured: float, with_cpu_work: bool) -> None:
        """`predicted`: as `corrected` gave it; the ratios compare the measurement with the profile's own time."""
        if with_cpu_work:
            predicted /= self.offload_slowdown
        if predicted <= 0 or measured <= 0:
            return
        ratio = measured / predicted
        if with_cpu_work:  # the first one counts like any other: it may carry one-off costs
            current = self.gpu_only_ratio if self.offload_ratio is None else self.offload_ratio
            self.offload_ratio = current + CORRECTION_SMOOTHING * (ratio - current)
            return
        self.gpu_only_ratio += CORRECTION_SMOOTHING * (ratio - self.gpu_only_ratio)
        # Without CPU work nothing re-measures it: forget slowly, so a CPU that was busy gets another try.
        self.cpu_correction += RECOVERY * (1.0 - self.cpu_correction)
        if self.offload_ratio is not None:
            self.offload_ratio += RECOVERY * (self.gpu_only_ratio - self.offload_ratio)


def fit_plane(rows: list[tuple[float, float]], ys: list[float]) -> tuple[float, float, float]:
    """y = a + b*x1 + c*x2 by least squares of the relative error (positive timings), coefficients clamped at >= 0.

    In absolute error the largest shape, ~25x the smallest, sets the plane: when it ran in the host's faster
    bandwidth mode, the intercept came out at several times a small batch's real time, and the scheduler, which
    decides on small host batches most often, then kept every request off the host."""
    import numpy as np

    y = np.array(ys)
    a = np.array([[1.0, x1, x2] for x1, x2 in rows]) / y[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    return tuple(float(max(c, 0.0)) for c in coef)


def load_cached(path: Path) -> PerfModel | None:
    try:
        data = json.loads(path.read_text())
        model = PerfModel(**data)
        model.reset_observations()
        return model
    except (OSError, ValueError, TypeError):
        return None


def save(model: PerfModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(model), indent=1))
    tmp.replace(path)
