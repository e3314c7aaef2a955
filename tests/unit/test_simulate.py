"""bench/simulate.py: the real scheduler on a simulated clock, the design tool RESULTS quotes."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import iterations  # noqa: E402
import simulate  # noqa: E402
from serving import make_trace, summarize  # noqa: E402


def run(policy: str, fit: simulate.Fit) -> tuple[dict, dict]:
    roof, gpu_blocks, cpu_gb = simulate.setting("t4mem", fit)
    trace = make_trace(20, 0.4, "a10g", 1000, 400)
    records, stats = simulate.simulate(policy, roof, gpu_blocks, cpu_gb, trace, {"cpu_latency_slack": 2.0})
    return summarize(records), stats


def test_offloading_serves_a_queue_the_device_pool_cannot_hold():
    """Two requests fit the device pool; at 0.4/s prompts queue for it. `never` keeps every decode on the device,
    `auto` moves requests to the host, answers prompts sooner and serves more tokens/s."""
    never, never_stats = run("never", simulate.FITS["h100"])
    auto, auto_stats = run("auto", simulate.FITS["h100"])
    assert never_stats["cpu_decode_rows"] == 0 and never_stats["swap_out_blocks"] == 0
    assert auto_stats["cpu_decode_rows"] > 0 and auto_stats["swap_out_blocks"] > 0
    assert auto["ttft_p50_s"] < never["ttft_p50_s"] / 2
    assert auto["output_tokens_per_s"] > never["output_tokens_per_s"]


def test_a_pipelined_steps_extra_cost_is_charged_only_to_pipelined_steps():
    fit = simulate.FITS["h100"]
    never, _ = run("never", replace(fit, pipelined_extra_s=0.0))
    never_extra, _ = run("never", replace(fit, pipelined_extra_s=0.05))
    assert never == never_extra
    auto, stats = run("auto", replace(fit, pipelined_extra_s=0.0))
    auto_extra, _ = run("auto", replace(fit, pipelined_extra_s=0.05))
    assert stats["modes"].get("pipelined") and auto_extra != auto


def test_the_iteration_log_reads_as_a_serving_runs(tmp_path):
    """Each simulated iteration is one row of the engine's iteration log, which bench/iterations.py groups."""
    roof, gpu_blocks, cpu_gb = simulate.setting("t4mem", simulate.FITS["h100"])
    log: list[dict] = []
    _, stats = simulate.simulate(
        "auto", roof, gpu_blocks, cpu_gb, make_trace(20, 0.4, "a10g", 1000, 400), {"cpu_latency_slack": 2.0}, log
    )
    assert len(log) == stats["iterations"]
    assert sum(row["cpu_decodes"] for row in log) == stats["cpu_decode_rows"] > 0
    assert all(a["t"] < b["t"] for a, b in zip(log, log[1:]))
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"run": "auto rate 0.40", **row}) + "\n" for row in log))
    rows = iterations.read_runs(path, "auto")["auto rate 0.40"]
    table = iterations.kinds_table(rows, top=50)
    assert sum(int(line.split("|")[4]) for line in table[2:]) == stats["iterations"]
    assert any(line.startswith("| sequential |") for line in table)
