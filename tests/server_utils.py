"""Metric checks of a real server for the tests (the server itself: loadtest.server.triton_server)."""

from __future__ import annotations

from collections.abc import Callable

from loadtest.metrics import Sample, metric_value, poll_metrics
from loadtest.server import RunningServer
from loadtest.soak import server_pids

DRAIN_TIMEOUT_S = 30.0  # generous: how quickly the engine drains is for benchmarks to measure, not for tests


def requests_in_engine(samples: list[Sample]) -> float:
    return metric_value(samples, "neo_requests")


def kv_blocks_used(samples: list[Sample]) -> float:
    return metric_value(samples, "neo_kv_blocks_used")


def wait_for_metrics(
    server: RunningServer, condition: Callable[[list[Sample]], bool], what: str, timeout: float = DRAIN_TIMEOUT_S
) -> list[Sample]:
    """The first scrape that meets `condition`, polled as a request's effect on the gauges lags it."""
    samples, met = poll_metrics(server.metrics_url, condition, timeout, interval=0.05)
    if not met:
        neo = [s for s in samples if s[0].startswith("neo_")]
        raise AssertionError(
            f"{what} not reached within {timeout:g} s; neo metrics: {neo}; log tail:\n{server.log_tail(3000)}"
        )
    return samples


def wait_idle(server: RunningServer, timeout: float = DRAIN_TIMEOUT_S) -> list[Sample]:
    """The first scrape with no request in the engine and no KV block in use."""
    return wait_for_metrics(
        server, lambda s: (requests_in_engine(s), kv_blocks_used(s)) == (0, 0), "an idle engine", timeout
    )


def descendant_pids(server: RunningServer) -> list[int]:
    """The server's processes: tritonserver, its python-backend stubs and what they started."""
    return server_pids(server.address.grpc_port)


def is_gone(pid: int) -> bool:
    """Whether a process has exited (a zombie has: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
