"""Reading the server's Prometheus page (:8002/metrics): samples and sums by name and labels."""
from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape_metrics(metrics_url: str, timeout: float = 10.0) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text page: (name, labels, value)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group("labels") or ""))
            samples.append((match.group("name"), labels, float(match.group("value"))))
    return samples


def metric_value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`; 0 when none."""
    return sum(value for sample_name, sample_labels, value in samples
               if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items()))
