"""What the blocking (sync.py) and asyncio (aio.py) clients share: where they connect, and one request's
parameters and outcome."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tritonclient.utils import InferenceServerException

from .errors import ClientError, RequestTimeoutError
from .protocol import GenerationResult, default_url, translate_error

# Extra seconds the gRPC stream deadline allows past the request timeout, so the client's own timeout (which
# cancels the request on the server) fires first.
STREAM_DEADLINE_GRACE_S = 5.0


class ClientBase:
    """A connection's settings: the server's gRPC address, the model and the default request timeout."""

    def __init__(self, url: str | None, model: str, timeout: float) -> None:
        self.url = url or default_url()
        self.model = model
        self.timeout = timeout

    def translate(self, exc: InferenceServerException) -> ClientError:
        return translate_error(exc, self.url, self.model, self.timeout)


class StreamBase:
    """One request: what it asks for, and once it finished, its `result`."""

    def __init__(
        self, owner: ClientBase, prompt: str, sampling: Mapping[str, Any] | None, request_id: str, timeout: float
    ) -> None:
        self._owner = owner
        self._prompt = prompt
        self._sampling = sampling
        self.request_id = request_id
        self.timeout = timeout
        self.result: GenerationResult | None = None

    def translate(self, exc: InferenceServerException) -> ClientError:
        return translate_error(exc, self._owner.url, self._owner.model, self.timeout)

    def timed_out(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"request {self.request_id} to {self._owner.url} did not complete within "
            f"{self.timeout:g} s and was cancelled; raise the timeout or lower max_tokens"
        )
