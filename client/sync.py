"""Blocking client: `NeoClient(url).stream(prompt, {...})` yields text deltas as they arrive.

tritonclient's sync gRPC client carries one bidirectional stream at a time, and an error on a stream arrives
without its request id, so every request gets a stream of its own on a pooled client; concurrent requests from
several threads (or gevent greenlets, as in the locust user) each borrow a client.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .base import STREAM_DEADLINE_GRACE_S, ClientBase, StreamBase
from .protocol import (
    DEFAULT_MODEL,
    DEFAULT_TIMEOUT_S,
    GenerationResult,
    ResponseAccumulator,
    build_inputs,
    model_not_ready,
)


class NeoClient(ClientBase):
    """A connection to one Triton server and model. Thread-safe; close it (or use `with`) when done."""

    def __init__(self, url: str | None = None, model: str = DEFAULT_MODEL, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(url, model, timeout)
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        """Raise `ServerUnreachableError` or `ModelNotFoundError` unless the model can take requests now."""
        client = self._acquire()
        try:
            try:
                client.is_server_live(client_timeout=self.timeout)
                if client.is_model_ready(self.model, client_timeout=self.timeout):
                    return
                index = client.get_model_repository_index(as_json=True, client_timeout=self.timeout)
            except InferenceServerException as exc:
                raise self.translate(exc) from None
            raise model_not_ready(self.url, self.model, index)
        finally:
            self._release(client)

    def stream(
        self,
        prompt: str,
        sampling: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Stream:
        """Start one streaming generation; iterate the returned `Stream` for text deltas."""
        return Stream(
            self, prompt, sampling, request_id or uuid.uuid4().hex, self.timeout if timeout is None else timeout
        )

    def generate(
        self, prompt: str, sampling: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> GenerationResult:
        """Run one request to completion and return its result."""
        with self.stream(prompt, sampling, timeout=timeout) as s:
            for _ in s:
                pass
        assert s.result is not None
        return s.result

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()

    def __enter__(self) -> NeoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _acquire(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return grpcclient.InferenceServerClient(self.url)

    def _release(self, client: grpcclient.InferenceServerClient) -> None:
        with self._lock:
            self._idle.append(client)


class Stream(StreamBase):
    """One request in flight. Iterating yields text deltas; afterwards `result` holds the outcome.

    Leaving the iteration early (break, an exception, Ctrl-C, closing the generator) cancels the request on the
    server through `stop_stream(cancel_requests=True)`.
    """

    def __init__(
        self, owner: NeoClient, prompt: str, sampling: Mapping[str, Any] | None, request_id: str, timeout: float
    ) -> None:
        super().__init__(owner, prompt, sampling, request_id, timeout)
        self._iterator: Iterator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        if self._iterator is None:
            self._iterator = self._run()
        return self._iterator

    def cancel(self) -> None:
        """Stop the request; the server aborts it and frees its KV blocks."""
        if self._iterator is not None:
            self._iterator.close()  # runs the generator's cleanup, which cancels

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()

    def _run(self) -> Iterator[str]:
        owner = self._owner
        responses: queue.Queue[tuple[Any, InferenceServerException | None, float]] = queue.Queue()
        client = owner._acquire()
        acc = ResponseAccumulator(self.request_id)
        deadline = acc.start_time + self.timeout
        finished = False
        try:
            client.start_stream(
                callback=lambda result, error: responses.put((result, error, time.perf_counter())),
                stream_timeout=self.timeout + STREAM_DEADLINE_GRACE_S,
            )
            client.async_stream_infer(
                owner.model,
                build_inputs(self._prompt, self._sampling),
                request_id=self.request_id,
                enable_empty_final_response=True,
            )
            while not acc.done:
                try:
                    result, error, arrival = responses.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    raise self.timed_out() from None
                if error is not None:
                    raise self.translate(error)
                delta = acc.feed(result, arrival).text
                if delta:
                    yield delta
            self.result = acc.result(time.perf_counter())
            finished = True
        except InferenceServerException as exc:
            raise self.translate(exc) from None
        finally:
            # A finished request's stream closes gracefully; anything else (error, timeout, Ctrl-C, early close)
            # cancels what is still running on the server.
            client.stop_stream(cancel_requests=not finished)
            owner._release(client)
