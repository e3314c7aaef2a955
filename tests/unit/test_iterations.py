"""bench/iterations.py: a serving run's iteration log grouped by kind and by time window."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import iterations  # noqa: E402


def step(t: float, run: str, mode: str, gpu: int, cpu: int, measured: float, waiting: int = 0) -> dict:
    return {
        "run": run,
        "t": t,
        "mode": mode,
        "prefill_tokens": 0,
        "gpu_decodes": gpu,
        "cpu_decodes": cpu,
        "predicted_s": measured * 1.1,
        "measured_s": measured,
        "measured_cpu_s": 0.005 * cpu,
        "schedule_s": 1e-4,
        "swap_s": 0.0,
        "requests_waiting": waiting,
        "requests_cpu_decode": cpu,
        "preemptions_by_cause": {},
        "cpu_correction": 1.0,
        "offload_slowdown": 1.0,
    }


def test_iterations_group_by_kind_and_window(tmp_path):
    rows = [step(0.02 * i, "never rate 0.4", "gpu_only", 2, 0, 0.020) for i in range(5)]
    rows += [step(0.03 * i, "auto rate 0.4", "gpu_only", 2, 0, 0.020) for i in range(3)]
    rows += [step(1 + 0.03 * i, "auto rate 0.4", "sequential", 2, 2, 0.030, waiting=3) for i in range(4)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))

    runs = iterations.read_runs(log, "auto")
    assert list(runs) == ["auto rate 0.4"] and len(runs["auto rate 0.4"]) == 7
    table = iterations.kinds_table(runs["auto rate 0.4"], top=5)
    assert table[2].startswith("| sequential |  | 2 / 2 | 4 | 0.1 | 30.0 | 33.0 | 10.0 / 10.0 |")
    assert table[3].startswith("| gpu_only |  | 2 / 0 | 3 | 0.1 | 20.0 | 22.0 |  |")
    windows = iterations.timeline(runs["auto rate 0.4"], 1.0)
    assert windows[2].startswith("| 0 | 3 | 0.0 | 2.0 / 0.0 |") and windows[3].startswith("| 1 | 4 | 3.0 | 2.0 / 2.0 |")
