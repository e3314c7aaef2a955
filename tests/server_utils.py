"""Start a real tritonserver for tests: free ports, a readiness wait, the log kept for failure messages, a clean stop.

    with triton_server({"num_gpu_blocks": 512}) as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

`triton_server` starts the server exactly as `python -m neo_backend serve` does (neo_backend.server.launch);
knob overrides are EngineConfig field names with values.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from loadtest.metrics import metric_value, scrape_metrics  # noqa: F401  (re-exported for the tests)
from neo_backend.server import (DEFAULT_MODEL_REPOSITORY, MODEL_NAME, ServerAddress, free_ports, is_ready,  # noqa: F401
                                launch, signal_server, stop_server)

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 30.0  # generous: how quickly the engine drains is for benchmarks to measure, not for tests
LOG_TAIL_CHARS = 6000


@dataclass
class RunningServer:
    process: subprocess.Popen
    address: ServerAddress
    log_path: Path
    model: str = MODEL_NAME

    @property
    def http_url(self) -> str:
        return self.address.url("http")

    @property
    def grpc_url(self) -> str:
        return self.address.url("grpc")

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address.url('metrics')}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log()[-chars:]

    def is_ready(self) -> bool:
        return is_ready(self.address, timeout=2)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode} before it was ready; "
                                   f"log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM to the server's process group, as `python -m neo_backend serve` sends it; does not wait."""
        signal_server(self.process, signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL if the server outlives `timeout`. Returns its exit status."""
        return stop_server(self.process, timeout)


@contextlib.contextmanager
def triton_server(overrides: Mapping[str, object] | None = None, *, ready_timeout: float = READY_TIMEOUT_S,
                  wait: bool = True, repository: Path = DEFAULT_MODEL_REPOSITORY,
                  extra_args: list[str] = ()) -> Iterator[RunningServer]:
    """A tritonserver on free local ports with the `neo` model; stopped (SIGTERM, then kill) on exit.

    With wait=False it yields as soon as the process runs (for tests of start-up failures); call wait_ready().
    """
    http, grpc, metrics = free_ports(3)
    address = ServerAddress("127.0.0.1", http, grpc, metrics)
    with tempfile.TemporaryDirectory(prefix="neo-test-server-") as work_dir:
        log_path = Path(work_dir) / "tritonserver.log"
        with open(log_path, "w") as log_file:
            process = launch(address, overrides, work_dir=Path(work_dir), repository=repository, stdout=log_file,
                             extra_args=extra_args)
        server = RunningServer(process, address, log_path)
        try:
            if wait:
                server.wait_ready(ready_timeout)
            yield server
        finally:
            server.stop()


def requests_in_engine(samples: list) -> float:
    return metric_value(samples, "neo_requests")


def kv_blocks_used(samples: list) -> float:
    return metric_value(samples, "neo_kv_blocks_used")


def wait_for_metrics(server: RunningServer, condition: Callable[[list], bool], what: str,
                     timeout: float = DRAIN_TIMEOUT_S) -> list:
    """The first scrape that meets `condition`. The model refreshes its gauges every 0.25 s, so a test polls
    rather than reading them once right after a request changed state."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape_metrics(server.metrics_url)
        if condition(samples):
            return samples
        if time.monotonic() > deadline:
            neo = [s for s in samples if s[0].startswith("neo_")]
            raise AssertionError(f"{what} not reached within {timeout:g} s; neo metrics: {neo}; log tail:\n"
                                 f"{server.log_tail(3000)}")
        time.sleep(0.05)


def wait_idle(server: RunningServer, timeout: float = DRAIN_TIMEOUT_S) -> list:
    """The first scrape with no request in the engine and no KV block in use."""
    return wait_for_metrics(server, lambda s: (requests_in_engine(s), kv_blocks_used(s)) == (0, 0), "an idle engine",
                            timeout)
