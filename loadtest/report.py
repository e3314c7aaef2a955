"""Summary table and latency-over-time chart from the per-request records of one run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .records import RequestRecord

METRICS = ("TTFT", "TPOT", "E2E")
PERCENTILES = (50, 90, 99)
PERCENTILE_WINDOW_S = 5.0  # the chart's percentiles are over requests that ended this recently


@dataclass
class Summary:
    title: str
    percentiles_ms: dict[str, dict[str, float | None]]  # metric -> {"p50": ms, ..., "mean": ms}
    requests_ok: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    first_errors: list[str]

    def table(self) -> str:
        header = f"{'metric':<8}" + "".join(f"{k:>10}" for k in [f"P{p} ms" for p in PERCENTILES] + ["mean ms"])
        lines = [f"== {self.title} ==", header]
        for metric in METRICS:
            row = self.percentiles_ms[metric]
            lines.append(f"{metric:<8}" + "".join("       n/a" if v is None else f"{v:>10.1f}" for v in row.values()))
        lines.append(
            f"requests: {self.requests_ok} ok, {self.errors} errors in {self.duration_s:.1f} s | "
            f"{self.requests_per_s:.2f} requests/s | {self.output_tokens_per_s:.1f} output tokens/s"
        )
        return "\n".join(lines)


def metric_values(records: list[RequestRecord], metric: str) -> np.ndarray:
    values = [getattr(r, metric.lower()) for r in records if r.ok]
    return np.array([v for v in values if v is not None], dtype=float)


def summarize(records: list[RequestRecord], title: str) -> Summary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    percentiles: dict[str, dict[str, float | None]] = {}
    for metric in METRICS:
        values = metric_values(records, metric) * 1000
        row: dict[str, float | None] = {
            f"p{p}": float(np.percentile(values, p)) if values.size else None for p in PERCENTILES
        }
        row["mean"] = float(values.mean()) if values.size else None
        percentiles[metric] = row
    tokens = sum(r.output_tokens for r in ok)
    return Summary(
        title=title,
        percentiles_ms=percentiles,
        requests_ok=len(ok),
        errors=len(failed),
        duration_s=duration,
        requests_per_s=len(ok) / duration if duration else 0.0,
        output_tokens_per_s=tokens / duration if duration else 0.0,
        first_errors=sorted({r.error or "" for r in failed})[:5],
    )


def write_summary(summary: Summary, results_dir: Path) -> None:
    (results_dir / "summary.txt").write_text(summary.table() + "\n", encoding="utf-8")
    (results_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2) + "\n", encoding="utf-8")


def plot_percentiles_over_time(records: list[RequestRecord], path: Path) -> None:
    """P50/P90/P99 of each metric over requests that finished in the trailing `PERCENTILE_WINDOW_S` seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((r for r in records if r.ok), key=lambda r: r.end)
    t0 = min((r.start for r in records), default=0.0)
    fig, axes = plt.subplots(len(METRICS), 1, figsize=(9, 8), sharex=True)
    for ax, metric in zip(axes, METRICS):
        points = [(r.end - t0, getattr(r, metric.lower()) * 1000) for r in ok if getattr(r, metric.lower()) is not None]
        if points:
            ends = np.array([p[0] for p in points])
            values = np.array([p[1] for p in points])
            grid = np.arange(1.0, ends.max() + 1.0, 1.0)
            for p in PERCENTILES:
                curve = [
                    np.percentile(values[(ends > t - PERCENTILE_WINDOW_S) & (ends <= t)], p)
                    if np.any((ends > t - PERCENTILE_WINDOW_S) & (ends <= t))
                    else np.nan
                    for t in grid
                ]
                ax.plot(grid, curve, marker=".", label=f"P{p}")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_ylabel(f"{metric} (ms)")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(f"seconds since start (percentiles over the trailing {PERCENTILE_WINDOW_S:g} s)")
    fig.suptitle("neo load test: latency percentiles over time")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
