"""A tritonserver of one's own, for the soak and the tests: started on free 127.0.0.1 ports exactly as
`python -m neo_backend serve` starts one (neo_backend.triton.server.launch), with its log in a file for failure
messages, a readiness wait that notices an early exit, and a clean stop.

    with triton_server({"num_gpu_blocks": 512}) as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

Knob overrides are EngineConfig field names with values.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from neo_backend.errors import NeoError
from neo_backend.triton.server import (
    DEFAULT_MODEL_REPOSITORY,
    MODEL_NAME,
    ServerAddress,
    free_ports,
    is_ready,
    launch,
    signal_server,
    stop_server,
)

READY_TIMEOUT_S = 300.0
LOG_TAIL_CHARS = 6000


class ServerStartError(NeoError):
    """A launched tritonserver exited, or was not ready in time; the message carries its log's tail."""


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

    def is_ready(self, timeout: float = 2.0) -> bool:
        return is_ready(self.address, timeout)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"tritonserver exited with {self.process.returncode} before it was ready; "
                    f"log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(f"tritonserver not ready after {timeout:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM to the server's process group, as `python -m neo_backend serve` sends it; does not wait."""
        signal_server(self.process, signal.SIGTERM)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if the server outlives its exit timeout. Returns its exit status."""
        return stop_server(self.process)


@contextlib.contextmanager
def triton_server(
    overrides: Mapping[str, object] | None = None,
    *,
    ready_timeout: float = READY_TIMEOUT_S,
    wait: bool = True,
    repository: Path = DEFAULT_MODEL_REPOSITORY,
    extra_args: list[str] = (),
) -> Iterator[RunningServer]:
    """A tritonserver on free local ports with the `neo` model; stopped (SIGTERM, then kill) on exit.

    With wait=False it yields as soon as the process runs (for tests of start-up failures); call wait_ready().
    """
    http, grpc, metrics = free_ports(3)
    address = ServerAddress("127.0.0.1", http, grpc, metrics)
    with tempfile.TemporaryDirectory(prefix="neo-server-") as work_dir:
        log_path = Path(work_dir) / "tritonserver.log"
        with open(log_path, "w") as log_file:
            process = launch(
                address,
                overrides,
                work_dir=Path(work_dir),
                repository=repository,
                stdout=log_file,
                extra_args=extra_args,
            )
        server = RunningServer(process, address, log_path)
        try:
            if wait:
                server.wait_ready(ready_timeout)
            yield server
        finally:
            startup_reported = isinstance(sys.exc_info()[1], ServerStartError)  # its message carries the tail
            if not startup_reported and not server.is_ready():  # the log goes with its temporary directory
                state = "alive" if server.process.poll() is None else f"exited with {server.process.returncode}"
                sys.stderr.write(f"tritonserver not ready at its stop ({state}); log tail:\n{server.log_tail()}\n")
            server.stop()
