"""Locust user that drives the `neo` model over Triton gRPC streaming through the project's client.

Entries are of type `grpc` (see loadtest/users.py for what is measured and how arrivals work). `--host` is the
gRPC address (host:port; default from NEO_HOST/NEO_GRPC_PORT).

Run directly (web UI): `locust -f loadtest/locustfile.py --host 127.0.0.1:8001`; headless: `python -m loadtest`.
"""

from __future__ import annotations

# grpc must be patched for gevent (which locust installs) before any channel exists.
from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()

from client import ClientError, GenerationResult, NeoClient, default_url  # noqa: E402
from loadtest.users import StreamingUser  # noqa: E402
from loadtest.workloads import RequestSpec  # noqa: E402


class NeoUser(StreamingUser):
    host = default_url()
    request_type = "grpc"
    request_errors = (ClientError,)

    def connect(self) -> None:
        self.client = NeoClient(self.host.removeprefix("grpc://"), self.opts.model, self.opts.request_timeout)
        self.client.check_ready()

    def disconnect(self) -> None:
        self.client.close()

    def send(self, spec: RequestSpec) -> GenerationResult:
        return self.client.generate(spec.prompt, spec.sampling())
