"""Reading the server's Prometheus page (:8002/metrics): samples, sums by name and labels, the engine's gauges,
and polling until they meet a condition."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]  # (name, labels, value)
SCRAPE_TIMEOUT_S = 10.0


def scrape_metrics(metrics_url: str) -> list[Sample]:
    """Samples of a Prometheus text page."""
    with urllib.request.urlopen(metrics_url, timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group("labels") or ""))
            samples.append((match.group("name"), labels, float(match.group("value"))))
    return samples


def metric_value(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`; 0 when none."""
    return sum(
        value
        for sample_name, sample_labels, value in samples
        if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
    )


def engine_gauges(samples: list[Sample]) -> dict[str, float]:
    """Requests in the engine and KV blocks used in each pool: all 0 once the server has drained."""
    return {
        "requests": metric_value(samples, "neo_requests"),
        "gpu_blocks_used": metric_value(samples, "neo_kv_blocks_used", pool="gpu"),
        "cpu_blocks_used": metric_value(samples, "neo_kv_blocks_used", pool="cpu"),
    }


def poll_metrics(
    metrics_url: str, condition: Callable[[list[Sample]], bool], timeout: float, interval: float
) -> tuple[list[Sample], bool]:
    """Scrape until `condition(samples)` holds or `timeout` passes: the last samples, and whether it held. The
    model refreshes its gauges every 0.25 s, so a caller polls rather than reading them once."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape_metrics(metrics_url)
        if condition(samples):
            return samples, True
        if time.monotonic() > deadline:
            return samples, False
        time.sleep(interval)
