"""Load test: workloads, prompt-length approximation, summary and chart, and a real ~20 s run against a server."""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadtest.__main__ import duration_seconds
from loadtest.records import RecordWriter, RequestRecord, read_records
from loadtest.report import plot_percentiles_over_time, summarize
from loadtest.server import RunningServer, triton_server
from loadtest.workloads import WORKLOADS, A10GSource, make_source, words

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer():
    from neo_backend import EngineConfig
    from neo_backend.models.loader import load_tokenizer, read_model_config, resolve_source

    config = EngineConfig()
    source = resolve_source(config)
    return load_tokenizer(source, config, read_model_config(source))


@pytest.mark.parametrize("n", [8, 128, 1000])
def test_word_prompts_have_the_requested_token_count(tokenizer, n):
    counts = [len(tokenizer.encode(words(random.Random(seed), n))) for seed in range(5)]
    assert all(abs(c - n) <= max(1, n // 100) for c in counts), counts


def test_conversation_prompt_lengths_are_close_to_nominal(tokenizer):
    source = make_source("conversation", seed=3)
    for i in range(12):
        spec = source.next_request()
        real = len(tokenizer.encode(spec.prompt))
        assert abs(real - spec.prompt_tokens) <= max(3, spec.prompt_tokens // 50), (real, spec.prompt_tokens)
        source.observe(spec, words(random.Random(i), spec.max_tokens))


@pytest.mark.parametrize("workload", WORKLOADS)
def test_workloads_are_seeded(workload):
    def draw(seed):
        source = make_source(workload, seed, input_tokens=16, output_tokens=4)
        specs = []
        for _ in range(20):
            specs.append(source.next_request())
            source.observe(specs[-1], "a reply")
        return specs

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert all(s.sampling()["ignore_eos"] and s.sampling()["max_tokens"] == s.max_tokens for s in draw(1))


def test_a10g_lengths_follow_the_paper():
    source = make_source("a10g", seed=0)
    specs = [source.next_request() for _ in range(2000)]
    outputs = [s.max_tokens for s in specs]
    assert {s.prompt_tokens for s in specs} == {A10GSource.INPUT_TOKENS}
    assert 45 <= min(outputs) < 60 and 380 < max(outputs) <= 440
    assert abs(statistics.mean(outputs) - 225) < 10


def test_conversation_history_grows_then_resets_and_is_capped():
    source = make_source("conversation", seed=5)
    source.END_CHAT_P = 0.0  # every reply continues the chat
    first = source.next_request()
    source.observe(first, "the reply")
    follow_up = source.next_request()
    assert follow_up.prompt.startswith(first.prompt + "the reply<|im_end|>\n<|im_start|>user\n")
    source.observe(follow_up, None)  # a failed request ends the chat
    assert source.next_request().prompt.count("<|im_start|>user") == 1
    for _ in range(200):  # long chats drop their oldest turns
        spec = source.next_request()
        assert spec.prompt_tokens <= source.MAX_HISTORY_TOKENS + source.TURN_WORDS[3] + 10
        source.observe(spec, "words " * spec.max_tokens)


def test_duration_syntax():
    assert [duration_seconds(d) for d in ("20s", "5m", "1h30m", "90")] == [20, 300, 5400, 90]
    with pytest.raises(argparse.ArgumentTypeError, match="bad duration"):
        duration_seconds("soon")


def test_summary_percentiles_and_chart(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "requests.jsonl"
    writer = RecordWriter(path)
    ttfts = rng.uniform(0.05, 0.5, 200)
    for i, ttft in enumerate(ttfts):
        writer.write(
            RequestRecord(
                start=1000.0 + i * 0.1,
                end=1001.0 + i * 0.1,
                ok=True,
                ttft=float(ttft),
                tpot=0.02,
                e2e=1.0,
                input_tokens=32,
                output_tokens=10,
            )
        )
    writer.write(RequestRecord(start=1010.0, end=1010.5, ok=False, error="ServerError: boom"))
    writer.close()
    records = list(read_records(path))
    summary = summarize(records, "synthetic")
    assert summary.requests_ok == 200 and summary.errors == 1
    assert summary.percentiles_ms["TTFT"]["p99"] == pytest.approx(np.percentile(ttfts, 99) * 1000)
    assert summary.percentiles_ms["TPOT"]["p50"] == pytest.approx(20.0)
    assert summary.output_tokens_per_s == pytest.approx(2000 / 20.9)
    table = summary.table().splitlines()
    assert table[1].split() == ["metric", "P50", "ms", "P90", "ms", "P99", "ms", "mean", "ms"]
    assert [line.split()[0] for line in table[2:5]] == ["TTFT", "TPOT", "E2E"]
    chart = tmp_path / "latency.png"
    plot_percentiles_over_time(records, chart)
    assert chart.read_bytes()[:8] == PNG_MAGIC


# Against a real server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> RunningServer:
    with triton_server({"num_gpu_blocks": 512, "max_model_len": 512, "cpu_kv_cache_gb": 0.05}) as running:
        yield running


def run_loadtest(server: RunningServer, results: Path, *args: str) -> subprocess.CompletedProcess:
    """The command `make loadtest` runs, with the server address from NEO_* as `make serve` takes it."""
    env = {**os.environ, "NEO_HOST": server.address.host, "NEO_GRPC_PORT": str(server.address.grpc_port)}
    return subprocess.run(
        [sys.executable, "-m", "loadtest", *args, "--results-dir", str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_loadtest_20s_closed_loop(server, tmp_path):
    proc = run_loadtest(
        server,
        tmp_path,
        "--duration",
        "20s",
        "--users",
        "4",
        "--workload",
        "fixed",
        "--input-tokens",
        "64",
        "--output-tokens",
        "12",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-5:]  # the summary table is the last lines
    assert last[0].split() == ["metric", "P50", "ms", "P90", "ms", "P99", "ms", "mean", "ms"]
    for line, metric in zip(last[1:4], ("TTFT", "TPOT", "E2E")):
        cells = line.split()
        assert cells[0] == metric and all(float(v) > 0 for v in cells[1:]), line
    ok, errors = map(int, re.search(r"requests: (\d+) ok, (\d+) errors", last[4]).groups())
    assert ok > 0 and errors == 0, last[4]  # throughput is what the load test reports, not what it is tested for
    assert float(re.search(r"([\d.]+) output tokens/s", last[4]).group(1)) > 0
    assert (tmp_path / "latency.png").read_bytes()[:8] == PNG_MAGIC
    with (tmp_path / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for metric in ("TTFT", "TPOT", "E2E"):
        assert int(rows[metric]["Request Count"]) == ok and rows[metric]["Failure Count"] == "0"
    assert (tmp_path / "locust_stats_history.csv").stat().st_size > 0
    records = list(read_records(tmp_path / "requests.jsonl"))
    assert {r.output_tokens for r in records} == {12} and all(abs(r.input_tokens - 64) <= 1 for r in records)


def test_loadtest_open_loop_poisson(server, tmp_path):
    proc = run_loadtest(
        server,
        tmp_path,
        "--duration",
        "8s",
        "--users",
        "2",
        "--rate",
        "2",
        "--input-tokens",
        "16",
        "--output-tokens",
        "4",
        "--seed",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Poisson 2 req/s" in proc.stdout
    records = list(read_records(tmp_path / "requests.jsonl"))
    assert 4 <= len(records) <= 40 and all(r.ok for r in records)


def test_loadtest_reports_the_requests_in_flight_at_its_end(server, tmp_path):
    """Closed loop keeps a request in flight at every moment, so one is running when the duration ends: it
    finishes and is reported instead of being cancelled and left out. The end is the time locust logs for it, not
    the first request's start plus the duration: its timer has fired 2.7 s into a 3 s run."""
    proc = run_loadtest(
        server, tmp_path, "--duration", "3s", "--users", "2", "--input-tokens", "16", "--output-tokens", "48"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(read_records(tmp_path / "requests.jsonl"))
    assert len(records) >= 2 and all(r.ok and r.output_tokens == 48 for r in records)
    logged = re.search(r"\[([\d-]+ [\d:]+,\d+)\][^\n]*--run-time limit reached", proc.stderr)
    assert logged, proc.stderr[-3000:]
    stopped = datetime.datetime.strptime(logged.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert any(r.start < stopped < r.end for r in records), (stopped, [(r.start, r.end) for r in records])
