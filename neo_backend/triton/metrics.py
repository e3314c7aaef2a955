"""The model's Triton custom metrics: request latency histograms, engine counters and gauges."""

from __future__ import annotations

import queue
from collections.abc import Mapping
from typing import Any

from ..core.outputs import RequestMetrics

LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
]
PER_TOKEN_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]


class NeoMetrics:
    """Triton custom metrics: request latency histograms, engine counters (as deltas of stats_snapshot) and gauges.

    `metric_family` is `pb_utils.MetricFamily` (a class with its HISTOGRAM, COUNTER and GAUGE kinds).
    `record` and `count_failure` only queue; `flush` and `refresh` touch the metrics and must run on one thread:
    metric updates from many threads at once crashed the 2.51 python backend (SIGSEGV in the server while it
    read a metric message).
    """

    HISTOGRAMS = {  # metric name -> (RequestMetrics attribute, description, buckets)
        "neo_time_to_first_token_seconds": (
            "time_to_first_token",
            "Time from arrival to the first output token",
            LATENCY_BUCKETS,
        ),
        "neo_time_per_output_token_seconds": (
            "time_per_output_token",
            "Mean time between output tokens",
            PER_TOKEN_BUCKETS,
        ),
        "neo_e2e_request_latency_seconds": ("e2e_latency", "Time from arrival to the last output", LATENCY_BUCKETS),
        "neo_request_queue_time_seconds": ("queue_time", "Time from arrival to the first schedule", LATENCY_BUCKETS),
    }
    COUNTERS = {  # (metric name, label) -> stats_snapshot key
        ("neo_prompt_tokens_total", ()): "prompt_tokens",
        ("neo_generation_tokens_total", ()): "generation_tokens",
        ("neo_preemptions_total", ()): "preemptions",
        ("neo_swapped_blocks_total", ("direction", "out")): "swap_out_blocks",
        ("neo_swapped_blocks_total", ("direction", "in")): "swap_in_blocks",
    }
    GAUGES = {
        ("neo_requests", ("state", "waiting")): "requests_waiting",
        ("neo_requests", ("state", "gpu_decode")): "requests_gpu_decode",
        ("neo_requests", ("state", "cpu_decode")): "requests_cpu_decode",
        ("neo_kv_blocks_used", ("pool", "gpu")): "gpu_blocks_used",
        ("neo_kv_blocks_used", ("pool", "cpu")): "cpu_blocks_used",
        ("neo_kv_blocks_total", ("pool", "gpu")): "gpu_blocks_total",
        ("neo_kv_blocks_total", ("pool", "cpu")): "cpu_blocks_total",
    }
    DESCRIPTIONS = {
        "neo_prompt_tokens_total": "Prompt tokens prefilled",
        "neo_generation_tokens_total": "Output tokens generated",
        "neo_preemptions_total": "Requests preempted for lack of KV blocks",
        "neo_swapped_blocks_total": "KV blocks moved between the GPU and CPU pools",
        "neo_request_failures_total": "Requests that failed, by reason",
        "neo_requests": "Requests in the engine, by state",
        "neo_kv_blocks_used": "KV cache blocks in use, by pool",
        "neo_kv_blocks_total": "KV cache blocks, by pool",
    }

    def __init__(self, labels: Mapping[str, str], metric_family: Any) -> None:
        self._labels = dict(labels)
        self._metric_family = metric_family
        self._families: dict[str, Any] = {}  # kept alive for as long as their metrics
        self._histograms = {
            attr: self._family(name, description, metric_family.HISTOGRAM).Metric(labels=self._labels, buckets=buckets)
            for name, (attr, description, buckets) in self.HISTOGRAMS.items()
        }
        self._counters = {key: self._metric(*key, metric_family.COUNTER) for key in self.COUNTERS}
        self._gauges = {key: self._metric(*key, metric_family.GAUGE) for key in self.GAUGES}
        self._failures: dict[str, Any] = {}
        self._last: dict[str, int] = {}
        self._pending: queue.SimpleQueue[RequestMetrics | str] = queue.SimpleQueue()

    def _family(self, name: str, description: str, kind: Any) -> Any:
        if name not in self._families:
            self._families[name] = self._metric_family(name=name, description=description, kind=kind)
        return self._families[name]

    def _metric(self, name: str, label: tuple[str, ...], kind: Any) -> Any:
        labels = {**self._labels, **dict([label] if label else [])}
        return self._family(name, self.DESCRIPTIONS[name], kind).Metric(labels=labels)

    def close(self) -> None:
        """Delete every metric, then their families, now (in finalize, while Triton still answers the stub): one left
        to the 2.51 stub's own teardown crashes it, as its destructor asks for a stub instance that is gone by then.
        """
        for metrics in (self._histograms, self._counters, self._gauges, self._failures):
            metrics.clear()
        self._families.clear()

    def record(self, metrics: RequestMetrics) -> None:
        """Queue a finished request's latencies for the histograms."""
        self._pending.put(metrics)

    def count_failure(self, reason: str) -> None:
        """Queue one failure of a request refused before it reached the engine."""
        self._pending.put(reason)

    def flush(self) -> None:
        while True:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):
                self._increment_failures(item, 1)
                continue
            for attr, histogram in self._histograms.items():
                value = getattr(item, attr)
                if value is not None:
                    histogram.observe(value)

    def _increment_failures(self, reason: str, n: int) -> None:
        if reason not in self._failures:
            self._failures[reason] = self._metric(
                "neo_request_failures_total", ("reason", reason), self._metric_family.COUNTER
            )
        self._failures[reason].increment(n)

    def refresh(self, snapshot: Mapping[str, Any]) -> None:
        for key, stat in self.COUNTERS.items():
            self._increment_to(stat, snapshot.get(stat, 0), self._counters[key])
        for reason, total in snapshot.get("failures", {}).items():
            delta = total - self._last.get("failures/" + reason, 0)
            if delta > 0:
                self._last["failures/" + reason] = total
                self._increment_failures(reason, delta)
        for key, stat in self.GAUGES.items():
            self._gauges[key].set(snapshot.get(stat, 0))

    def _increment_to(self, stat: str, total: int, counter: Any) -> None:
        delta = total - self._last.get(stat, 0)
        if delta > 0:
            self._last[stat] = total
            counter.increment(delta)
