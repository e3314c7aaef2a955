"""`python -m loadtest.soak --duration SECONDS [--url host:port] [--metrics-url URL] [--concurrency N]`.

A mixed load for a set time against a real Triton server serving `neo`, then checks of what it left behind.
Every worker loops (bounded by the deadline; every call has a timeout) over four kinds of request:
  stream   a normal streamed generation (ignore_eos, so its token count is exact and checked)
  cancel   a stream cancelled by the client after a random number of deltas (stop_stream(cancel_requests=True))
  drop     a stream whose client closes its gRPC channel mid-way (a dropped connection)
  bad      a request the server must refuse (unknown sampling keys such as "model", invalid JSON, non-UTF-8, limits);
           the error must name the problem ("expected error")
At the end, after the server drained: zero unexpected errors; neo_kv_blocks_used back to 0 in both pools and
neo_requests at 0; the RSS and pinned memory (VmPin + VmLck) of the tritonserver process and its python-backend
stub, read from /proc, compared between an idle point after a warm-up and the end. Exit status 0 only when every
check passes.

Without --url it starts its own server on free 127.0.0.1 ports (loadtest.server, as `make serve` starts one)
with small KV pools and offload_policy=always, so both pools see traffic; --knob key=value changes its knobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tritonclient.grpc as grpcclient

from client import ClientError, NeoClient
from client.protocol import raw_inputs

from .metrics import engine_gauges, poll_metrics, scrape_metrics
from .server import triton_server
from .workloads import WORDS

MODEL = "neo"
KINDS = ("stream", "cancel", "drop", "bad")
WEIGHTS = {"stream": 4, "cancel": 3, "drop": 2, "bad": 2}
# Knobs of the server this module starts itself: small pools, every decode on the CPU pool.
DEFAULT_SERVER_KNOBS = {
    "num_gpu_blocks": 512,
    "max_num_seqs": 64,
    "max_model_len": 512,
    "cpu_kv_cache_gb": 0.1,
    "offload_policy": "always",
}
DRAIN_TIMEOUT_S = 30.0
OWN_SERVER_READY_TIMEOUT_S = 600.0
RSS_TOLERANCE_MB = 128.0
PINNED_TOLERANCE_MB = 1.0

# (name, sampling parameters or a raw builder, substring the error must contain)
BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("sampling key model", {"max_tokens": 4, "model": "/etc/passwd"}, "unknown sampling parameter(s): model"),
    (
        "sampling key download_dir",
        {"max_tokens": 4, "download_dir": "/tmp/x", "load_format": "pt"},
        "unknown sampling parameter(s)",
    ),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens must be >= 1"),
    ("max_tokens huge", {"max_tokens": 10**12}, "exceeds the server's limit"),
    ("too many stop strings", {"max_tokens": 4, "stop": ["x"] * 64}, "stop strings exceed the server's limit"),
    ("stop string too long", {"max_tokens": 4, "stop": ["y" * 5000]}, "longer than the server's limit"),
    ("logprobs too many", {"max_tokens": 4, "logprobs": 10**6}, "logprobs 1000000 exceeds"),
    ("temperature not a number", {"max_tokens": 4, "temperature": "hot"}, "temperature"),
    ("invalid JSON", b"{not json", "sampling_parameters is not valid JSON"),
    ("JSON not an object", b"[1, 2]", "must be a JSON object"),
    ("non-UTF-8 prompt", "non-utf8", "text_input is not valid UTF-8"),
    ("empty prompt", "empty", "prompt is empty"),
]


# Requests -------------------------------------------------------------------------------------------------------


@dataclass
class RawOutcome:
    responses: int = 0
    error: str | None = None
    final: bool = False
    timed_out: bool = False


def raw_stream(
    url: str, inputs: list[grpcclient.InferInput], timeout: float, *, drop_after: int | None = None
) -> RawOutcome:
    """One request on its own gRPC stream, read to its final response (or `timeout`).

    With drop_after=N the client reads N responses and then closes its gRPC channel without a word (a client whose
    connection went away); the outcome then only says whether the request got that far.
    """
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    outcome = RawOutcome()
    deadline = time.monotonic() + timeout
    dropped = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=timeout + 5)
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        while not outcome.final:
            if drop_after is not None and outcome.responses >= drop_after:
                client._channel.close()  # the connection goes away under the running request
                dropped = True
                return outcome
            try:
                result, error = responses.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                outcome.timed_out = True
                return outcome
            if error is not None:
                outcome.error, outcome.final = error.message() if hasattr(error, "message") else str(error), True
                return outcome
            outcome.responses += 1
            final = result.get_response().parameters.get("triton_final_response")
            outcome.final = bool(final and final.bool_param)
        return outcome
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream(cancel_requests=not outcome.final or dropped)
        with contextlib.suppress(Exception):
            client.close()


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


# Server processes and metrics ----------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def server_pids(grpc_port: int) -> list[int]:
    """The tritonserver launched with --grpc-port=PORT and its descendants (python-backend stubs), from /proc."""
    parents: dict[int, int] = {}
    roots = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        argv = _read(f"/proc/{pid}/cmdline").split("\0")
        if argv and argv[0].endswith("tritonserver") and f"--grpc-port={grpc_port}" in argv:
            roots.append(pid)
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in found and pid not in found:
                found.add(pid)
                grew = True
    return sorted(found)


@dataclass
class MemorySample:
    rss_mb: float
    pinned_mb: float  # VmPin + VmLck
    pids: list[int]

    def __str__(self) -> str:
        return f"RSS {self.rss_mb:.1f} MiB, pinned {self.pinned_mb:.1f} MiB over pids {self.pids}"


def memory_sample(pids: list[int]) -> MemorySample:
    rss = pinned = 0.0
    alive = []
    for pid in pids:
        status = _read(f"/proc/{pid}/status")
        if not status:
            continue
        alive.append(pid)
        fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", status, re.M))
        rss += int(fields.get("VmRSS", 0)) / 1024
        pinned += (int(fields.get("VmPin", 0)) + int(fields.get("VmLck", 0))) / 1024
    return MemorySample(rss, pinned, alive)


def failures_by_reason(metrics_url: str) -> Counter:
    return Counter(
        {ls.get("reason", ""): v for n, ls, v in scrape_metrics(metrics_url) if n == "neo_request_failures_total"}
    )


def wait_idle(metrics_url: str) -> dict[str, float]:
    """Poll until no request is in the engine and no KV block is used; the last gauges either way."""
    samples, _ = poll_metrics(metrics_url, lambda s: not any(engine_gauges(s).values()), DRAIN_TIMEOUT_S, interval=0.25)
    return engine_gauges(samples)


# The soak ------------------------------------------------------------------------------------------------------


@dataclass
class SoakReport:
    duration_s: float = 0.0
    sent: Counter = field(default_factory=Counter)  # by kind
    completed: Counter = field(default_factory=Counter)  # by kind: went as that kind should
    expected_errors_sent: int = 0
    expected_errors_seen: int = 0
    unexpected: list[str] = field(default_factory=list)
    gauges_before: dict[str, float] = field(default_factory=dict)
    gauges_after: dict[str, float] = field(default_factory=dict)
    memory_start: MemorySample | None = None
    memory_baseline: MemorySample | None = None  # idle, after the warm-up
    memory_end: MemorySample | None = None
    failures_delta: dict[str, float] = field(default_factory=dict)
    rss_trace: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the load, RSS MiB)
    output_tokens: int = 0
    rss_tolerance_mb: float = RSS_TOLERANCE_MB
    pinned_tolerance_mb: float = PINNED_TOLERANCE_MB

    @property
    def requests_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def blocks_leaked(self) -> dict[str, float]:
        return {pool: self.gauges_after.get(f"{pool}_blocks_used", float("nan")) for pool in ("gpu", "cpu")}

    @property
    def rss_drift_mb(self) -> float | None:
        if self.memory_baseline is None or self.memory_end is None:
            return None
        return self.memory_end.rss_mb - self.memory_baseline.rss_mb

    @property
    def pinned_drift_mb(self) -> float | None:
        if self.memory_baseline is None or self.memory_end is None:
            return None
        return self.memory_end.pinned_mb - self.memory_baseline.pinned_mb

    def failures(self) -> list[str]:
        problems = []
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected error(s), first: {self.unexpected[:3]}")
        if self.expected_errors_seen != self.expected_errors_sent:
            problems.append(
                f"{self.expected_errors_sent} bad requests sent but {self.expected_errors_seen} got the expected error"
            )
        if self.gauges_after.get("requests", 1) != 0:
            problems.append(f"{self.gauges_after.get('requests')} request(s) still in the engine after the drain")
        leaked = {p: n for p, n in self.blocks_leaked.items() if n != 0}
        if leaked:
            problems.append(f"KV blocks leaked: {leaked}")
        if self.sent["stream"] and not self.completed["stream"]:
            problems.append("no normal stream completed")
        if self.rss_drift_mb is None:
            problems.append("no server process found for the memory check (pass --server-pid)")
        else:
            if self.rss_drift_mb > self.rss_tolerance_mb:
                problems.append(f"RSS grew {self.rss_drift_mb:.1f} MiB (> {self.rss_tolerance_mb:g} MiB)")
            if self.pinned_drift_mb > self.pinned_tolerance_mb:
                problems.append(
                    f"pinned memory grew {self.pinned_drift_mb:.1f} MiB (> {self.pinned_tolerance_mb:g} MiB)"
                )
        return problems

    @property
    def ok(self) -> bool:
        return not self.failures()

    def summary(self) -> str:
        def mem(sample: MemorySample | None) -> str:
            return "n/a" if sample is None else f"{sample.rss_mb:.1f} MiB RSS / {sample.pinned_mb:.1f} MiB pinned"

        drift = (
            "n/a"
            if self.rss_drift_mb is None
            else f"RSS {self.rss_drift_mb:+.1f} MiB, pinned {self.pinned_drift_mb:+.1f} MiB (end vs idle after warm-up)"
        )
        lines = [
            f"soak: {self.duration_s:.0f} s, {self.requests_sent} requests sent "
            f"({', '.join(f'{k} {self.sent[k]}' for k in KINDS)}), {self.output_tokens} output tokens",
            f"  went as intended:    {', '.join(f'{k} {self.completed[k]}' for k in KINDS)}",
            f"  expected errors:     sent {self.expected_errors_sent}, seen {self.expected_errors_seen}",
            f"  unexpected errors:   {len(self.unexpected)}",
            f"  server failures:     {dict(self.failures_delta) or 'none'} (neo_request_failures_total, delta)",
            f"  after drain:         requests {self.gauges_after.get('requests')}, KV blocks leaked gpu "
            f"{self.blocks_leaked['gpu']:g} cpu {self.blocks_leaked['cpu']:g}",
            f"  memory start:        {mem(self.memory_start)}",
            f"  memory idle warm:    {mem(self.memory_baseline)}",
            f"  memory end:          {mem(self.memory_end)}",
            f"  drift:               {drift}",
            "  RSS during the load: " + (", ".join(f"{t:.0f}s {m:.0f}" for t, m in self.rss_trace) or "n/a") + " (MiB)",
        ]
        for unexpected in self.unexpected[:5]:
            lines.append(f"  unexpected: {unexpected}")
        failures = self.failures()
        lines.append("  result:              " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
        return "\n".join(lines)


class _Soak:
    def __init__(self, url: str, report: SoakReport, request_timeout: float, weights: Mapping[str, int]) -> None:
        self.url = url
        self.report = report
        self.timeout = request_timeout
        self.kinds = [k for k in KINDS for _ in range(weights.get(k, 0))]
        self.client = NeoClient(url, MODEL, timeout=request_timeout)
        self.lock = threading.Lock()

    def count(self, counter: str, kind: str) -> None:
        with self.lock:
            getattr(self.report, counter)[kind] += 1

    def unexpected(self, kind: str, message: str) -> None:
        with self.lock:
            self.report.unexpected.append(f"{kind}: {message[:300]}")

    def one(self, kind: str, rng: random.Random) -> None:
        self.count("sent", kind)
        try:
            getattr(self, "_" + kind)(rng)
        except ClientError as exc:
            self.unexpected(kind, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the soak counts everything, it must not die
            self.unexpected(kind, f"client-side {type(exc).__name__}: {exc}")

    def _stream(self, rng: random.Random) -> None:
        max_tokens = rng.randint(4, 24)
        prompt = random_prompt(rng)
        sampling = {
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": rng.choice([0, 0.8]),
            "seed": rng.randint(0, 99),
        }
        result = self.client.generate(prompt, sampling)
        with self.lock:
            self.report.output_tokens += result.num_output_tokens
        if result.finish_reason != "length" or result.num_output_tokens != max_tokens:
            self.unexpected(
                "stream", f"finish_reason {result.finish_reason}, {result.num_output_tokens} tokens of {max_tokens}"
            )
        else:
            self.count("completed", "stream")

    def _cancel(self, rng: random.Random) -> None:
        max_tokens = rng.randint(16, 64)
        after = rng.randint(0, max_tokens // 2)
        with self.client.stream(random_prompt(rng), {"max_tokens": max_tokens, "ignore_eos": True}) as s:
            for i, _ in enumerate(s):
                if i >= after:
                    break  # leaving the with-block cancels the request on the server
        self.count("completed", "cancel")

    def _drop(self, rng: random.Random) -> None:
        sampling = json.dumps({"max_tokens": rng.randint(16, 64), "ignore_eos": True}).encode()
        outcome = raw_stream(
            self.url, raw_inputs(random_prompt(rng).encode(), sampling), self.timeout, drop_after=rng.randint(1, 6)
        )
        if outcome.error is not None or outcome.timed_out:
            self.unexpected("drop", outcome.error or f"no response within {self.timeout:g} s")
        else:
            self.count("completed", "drop")

    def _bad(self, rng: random.Random) -> None:
        name, sampling, expected = rng.choice(BAD_REQUESTS)
        prompt = random_prompt(rng).encode()
        if sampling == "non-utf8":
            prompt, sampling = b"caf\xe9 \xff\xfe", {"max_tokens": 4}
        elif sampling == "empty":
            prompt, sampling = b"", {"max_tokens": 4}
        body = sampling if isinstance(sampling, bytes) else json.dumps(sampling).encode()
        with self.lock:
            self.report.expected_errors_sent += 1
        outcome = raw_stream(self.url, raw_inputs(prompt, body), self.timeout)
        if outcome.error is not None and expected in outcome.error:
            with self.lock:
                self.report.expected_errors_seen += 1
            self.count("completed", "bad")
        else:
            got = outcome.error or ("timed out" if outcome.timed_out else f"{outcome.responses} responses, no error")
            self.unexpected("bad", f"{name}: expected an error containing {expected!r}, got {got}")

    def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            self.one(rng.choice(self.kinds), rng)

    def run_workers(self, concurrency: int, seed: int, deadline: float) -> None:
        threads = [
            threading.Thread(target=self.worker, args=(seed * 1000 + i, deadline), daemon=True, name=f"soak-{i}")
            for i in range(concurrency)
        ]
        for t in threads:
            t.start()
        # Each worker stops at the deadline after its current request, which its timeout bounds.
        join_by = max(deadline, time.monotonic()) + self.timeout + 15
        for t in threads:
            t.join(max(0.1, join_by - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.unexpected("worker", f"{stuck} did not finish within their request timeout")


def run_soak(
    url: str,
    metrics_url: str,
    duration_s: float,
    *,
    concurrency: int = 8,
    seed: int = 0,
    request_timeout: float = 60.0,
    pids: list[int] | None = None,
    rss_tolerance_mb: float = RSS_TOLERANCE_MB,
    log: Callable[[str], None] = print,
) -> SoakReport:
    """Run the mixed load against a ready server for `duration_s` seconds and return the report.

    A warm-up (one request of each kind per worker) comes first, so the memory baseline is taken idle with every
    code path touched. `pids` (the server and its stubs) default to the tritonserver on the gRPC port of `url`.
    """
    report = SoakReport(rss_tolerance_mb=rss_tolerance_mb)
    if pids is None:
        pids = server_pids(int(url.rsplit(":", 1)[1]))
    report.memory_start = memory_sample(pids) if pids else None
    report.gauges_before = wait_idle(metrics_url)
    failures_before = failures_by_reason(metrics_url)
    soak = _Soak(url, report, request_timeout, WEIGHTS)
    warm = _Soak(url, SoakReport(), request_timeout, {k: 1 for k in KINDS})
    started = time.monotonic()
    try:
        log(f"soak: warm-up against {url} ({concurrency} workers)")
        for i, kind in enumerate(KINDS):
            threads = [
                threading.Thread(target=warm.one, args=(kind, random.Random(seed + 17 * i + j)), daemon=True)
                for j in range(concurrency)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(request_timeout + 15)
        report.unexpected += [f"warm-up {u}" for u in warm.report.unexpected]
        wait_idle(metrics_url)
        report.memory_baseline = memory_sample(pids) if pids else None
        log(f"soak: idle after warm-up: {report.memory_baseline}; running {duration_s:g} s")
        stop_sampling = threading.Event()

        def sample_rss(load_started: float = time.monotonic(), every: float = max(2.0, duration_s / 12)) -> None:
            while pids and not stop_sampling.wait(every):
                report.rss_trace.append((time.monotonic() - load_started, memory_sample(pids).rss_mb))

        sampler = threading.Thread(target=sample_rss, daemon=True, name="soak-rss")
        sampler.start()
        soak.run_workers(concurrency, seed, time.monotonic() + duration_s)
        stop_sampling.set()
        sampler.join(5)
        report.duration_s = time.monotonic() - started
        report.gauges_after = wait_idle(metrics_url)
        report.memory_end = memory_sample(pids) if pids else None
        after = failures_by_reason(metrics_url)
        report.failures_delta = {
            k: after[k] - failures_before.get(k, 0) for k in after if after[k] != failures_before.get(k, 0)
        }
    finally:
        soak.client.close()
        warm.client.close()
    return report


# CLI -------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, required=True, help="seconds of mixed load (after the warm-up)")
    p.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    p.add_argument("--metrics-url", default=None, help="its metrics page (default: http://HOST:8002/metrics)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds allowed per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-pid",
        type=int,
        action="append",
        default=None,
        help="pid(s) whose memory to watch (default: the tritonserver on the --url port and its stubs)",
    )
    p.add_argument("--rss-tolerance-mb", type=float, default=RSS_TOLERANCE_MB)
    p.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"knob of the server this starts (defaults: {DEFAULT_SERVER_KNOBS})",
    )
    args = p.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1:
        p.error("--duration must be > 0 and --concurrency >= 1")
    if args.url and not args.metrics_url:
        args.metrics_url = f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    try:
        args.knobs = {**DEFAULT_SERVER_KNOBS, **dict(k.split("=", 1) for k in args.knob)}
    except ValueError:
        p.error("--knob takes KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def soak(url: str, metrics_url: str, pids: list[int] | None) -> int:
        report = run_soak(
            url,
            metrics_url,
            args.duration,
            concurrency=args.concurrency,
            seed=args.seed,
            request_timeout=args.request_timeout,
            pids=pids,
            rss_tolerance_mb=args.rss_tolerance_mb,
            log=log,
        )
        print(report.summary(), flush=True)
        return 0 if report.ok else 1

    if args.url:
        return soak(args.url, args.metrics_url, args.server_pid)
    log(f"soak: starting a tritonserver on 127.0.0.1 with knobs {args.knobs}")
    with triton_server(args.knobs, ready_timeout=OWN_SERVER_READY_TIMEOUT_S) as server:
        time.sleep(1.0)  # let the stub settle before the memory snapshot
        return soak(server.grpc_url, server.metrics_url, args.server_pid or server_pids(server.address.grpc_port))


if __name__ == "__main__":
    sys.exit(main())
