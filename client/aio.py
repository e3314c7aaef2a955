"""asyncio client: `async for delta in AsyncNeoClient(url).stream(prompt, {...})`.

Each request is its own gRPC stream on the client's one channel, so any number may run concurrently.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import grpc
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from .base import STREAM_DEADLINE_GRACE_S, ClientBase, StreamBase
from .protocol import (
    DEFAULT_MODEL,
    DEFAULT_TIMEOUT_S,
    Delta,
    GenerationResult,
    ResponseAccumulator,
    build_inputs,
    model_not_ready,
)


class AsyncNeoClient(ClientBase):
    """A connection to one Triton server and model; `await close()` (or `async with`) when done."""

    def __init__(self, url: str | None = None, model: str = DEFAULT_MODEL, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(url, model, timeout)
        self._client = aioclient.InferenceServerClient(self.url)

    async def check_ready(self) -> None:
        """Raise `ServerUnreachableError` or `ModelNotFoundError` unless the model can take requests now."""
        try:
            await self._client.is_server_live(client_timeout=self.timeout)
            if await self._client.is_model_ready(self.model, client_timeout=self.timeout):
                return
            index = await self._client.get_model_repository_index(as_json=True, client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise self.translate(exc) from None
        raise model_not_ready(self.url, self.model, index)

    async def model_config(self) -> dict[str, Any]:
        """The model's configuration as the server loaded it (config.pbtxt as JSON, parameters included)."""
        try:
            response = await self._client.get_model_config(self.model, as_json=True, client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise self.translate(exc) from None
        return response["config"]

    def stream(
        self,
        prompt: str,
        sampling: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncStream:
        return AsyncStream(
            self, prompt, sampling, request_id or uuid.uuid4().hex, self.timeout if timeout is None else timeout
        )

    async def generate(
        self, prompt: str, sampling: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> GenerationResult:
        async with self.stream(prompt, sampling, timeout=timeout) as s:
            async for _ in s:
                pass
        assert s.result is not None
        return s.result

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> AsyncNeoClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncStream(StreamBase):
    """One request in flight: `async for` yields text deltas (`deltas()`: every response, logprobs included), then
    `result` holds the outcome.

    Leaving early (break, an exception, task cancellation, `aclose()`) cancels the gRPC call, which cancels the
    request on the server.
    """

    def __init__(
        self, owner: AsyncNeoClient, prompt: str, sampling: Mapping[str, Any] | None, request_id: str, timeout: float
    ) -> None:
        super().__init__(owner, prompt, sampling, request_id, timeout)
        self._iterator: AsyncIterator[Delta] | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._texts()

    def deltas(self) -> AsyncIterator[Delta]:
        """Each response's text and logprobs; responses that carry neither (the end) are left out."""
        if self._iterator is None:
            self._iterator = self._run()
        return self._iterator

    async def _texts(self) -> AsyncIterator[str]:
        async for delta in self.deltas():
            if delta.text:
                yield delta.text

    async def aclose(self) -> None:
        """Cancel the request if it is still running."""
        if self._iterator is not None:
            await self._iterator.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _run(self) -> AsyncIterator[Delta]:
        owner = self._owner

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {
                "model_name": owner.model,
                "inputs": build_inputs(self._prompt, self._sampling),
                "request_id": self.request_id,
            }

        acc = ResponseAccumulator(self.request_id)
        deadline = acc.start_time + self.timeout
        responses = owner._client.stream_infer(one_request(), stream_timeout=self.timeout + STREAM_DEADLINE_GRACE_S)
        finished = False
        try:
            while not acc.done:
                remaining = max(0.0, deadline - time.perf_counter())
                try:
                    result, error = await asyncio.wait_for(responses.__anext__(), remaining)
                except asyncio.TimeoutError:
                    raise self.timed_out() from None
                except StopAsyncIteration:
                    raise self.translate(
                        InferenceServerException("the server closed the stream before the request finished")
                    ) from None
                if error is not None:
                    raise self.translate(error)
                delta = acc.feed(result, time.perf_counter())
                if delta.text or delta.logprobs:
                    yield delta
            self.result = acc.result(time.perf_counter())
            finished = True
        except InferenceServerException as exc:
            raise self.translate(exc) from None
        except grpc.RpcError as exc:  # the aio stream lets transport errors through unwrapped
            raise self.translate(InferenceServerException(msg=exc.details(), status=str(exc.code()))) from None
        finally:
            if not finished:
                responses.cancel()
