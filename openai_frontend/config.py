"""The gateway's settings: where it listens, which Triton server and model it fronts, its optional API key."""

from __future__ import annotations

import os
from dataclasses import dataclass

from client import DEFAULT_MODEL, default_url
from neo_backend.errors import ConfigError

DEFAULT_PORT = 9000


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    triton_url: str = "127.0.0.1:8001"  # gRPC host:port of tritonserver
    model: str = DEFAULT_MODEL  # the Triton model, and the id OpenAI clients name
    api_key: str | None = None  # when set, /v1 requests must send `Authorization: Bearer <key>`
    request_timeout_s: float = 600.0  # per generation; past it the request is cancelled on the server

    @property
    def url(self) -> str:
        """The base URL a client on this machine reaches the gateway at."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_env(cls) -> GatewayConfig:
        """NEO_OPENAI_HOST (else NEO_HOST), NEO_OPENAI_PORT, NEO_OPENAI_API_KEY; Triton's gRPC address from
        NEO_OPENAI_TRITON_URL, else NEO_HOST / NEO_GRPC_PORT as the rest of the stack reads them."""
        environ = os.environ
        port = environ.get("NEO_OPENAI_PORT") or str(DEFAULT_PORT)
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"environment variable NEO_OPENAI_PORT={port!r} is not a port number (1-65535)")
        return cls(
            host=environ.get("NEO_OPENAI_HOST") or environ.get("NEO_HOST") or cls.host,
            port=int(port),
            triton_url=environ.get("NEO_OPENAI_TRITON_URL") or default_url(),
            api_key=environ.get("NEO_OPENAI_API_KEY") or None,
        )
