"""bench/serving.py's report: a sweep split by rate over several runs merges into the report of the whole sweep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serving  # noqa: E402


def row(rate: float, tokens_per_s: float, per_token_s: float, tpot_p99_s: float) -> dict:
    return {
        "rate": rate,
        "failed": 0,
        "output_tokens_per_s": tokens_per_s,
        "mean_per_token_latency_s": per_token_s,
        "tpot_p99_s": tpot_p99_s,
    }


SWEEP = {
    "never": [row(0.1, 24, 0.018, 0.017), row(0.3, 60, 0.026, 0.020), row(0.4, 85, 0.090, 0.021)],
    "auto": [row(0.1, 24, 0.018, 0.017), row(0.3, 61, 0.024, 0.035), row(0.4, 105, 0.033, 0.045)],
}


def write(tmp_path: Path, name: str, rates: set[float], num_gpu_blocks: int = 185) -> Path:
    results = {policy: [r for r in rows if r["rate"] in rates] for policy, rows in SWEEP.items()}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(serving.build_report(results, {}, 1.5, num_gpu_blocks, {"part": name})))
    return path


def test_a_sweep_split_by_rate_merges_into_the_whole_sweeps_report(tmp_path):
    heavy, light = write(tmp_path, "heavy", {0.4}), write(tmp_path, "light", {0.1, 0.3})
    merged = serving.merge_reports([heavy, light], 1.5)
    whole = serving.build_report({p: list(rows) for p, rows in SWEEP.items()}, {}, 1.5, 185, {})
    for key in serving.SUMMARY_KEYS:
        assert merged.get(key) == whole.get(key), key
    assert [r["rate"] for r in merged["results"]["never"]] == [0.1, 0.3, 0.4]
    assert merged["paper_metric"]["ratios_over_never"]["auto"] == pytest.approx(105 / 60)
    assert merged["args"] == [{"part": "heavy"}, {"part": "light"}]


def test_reports_of_different_settings_or_a_rate_measured_twice_do_not_merge(tmp_path):
    light = write(tmp_path, "light", {0.1, 0.3})
    with pytest.raises(SystemExit, match="device pools"):
        serving.merge_reports([light, write(tmp_path, "other", {0.4}, num_gpu_blocks=3606)], 1.5)
    with pytest.raises(SystemExit, match="more than once"):
        serving.merge_reports([light, write(tmp_path, "again", {0.3, 0.4})], 1.5)


def test_the_paper_metric_splits_into_the_wait_for_the_first_token_and_decoding():
    """Mean per-token latency is the mean over requests of (end - start) / tokens; its decode part leaves the wait
    for the first token out. A failed request counts in neither."""
    records = [
        serving.Record(start=0.0, first=1.0, end=3.0, tokens=4),  # 0.75 a token, 0.5 of it decoding
        serving.Record(start=1.0, first=1.5, end=2.5, tokens=2),  # 0.75 a token, 0.5 of it decoding
        serving.Record(start=2.0, first=2.1, end=2.3, tokens=1, error="aborted"),
    ]
    summary = serving.summarize(records)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["mean_per_token_latency_s"] == pytest.approx(0.75)
    assert summary["mean_per_token_decode_s"] == pytest.approx(0.5)
