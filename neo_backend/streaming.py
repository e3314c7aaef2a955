"""Thread-safe streaming front: a background loop thread drives the engine; each request reads its own queue.

Only the loop thread touches engine state. Callers validate and tokenize on their own thread
(`submit` raises request errors synchronously), then hand the sequence to the loop through an inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .config import EngineConfig
from .core.outputs import RequestOutput
from .core.sampling_params import SamplingParams
from .cpu.affinity import attention_cpus, pin_current_thread
from .engine import LLMEngine
from .errors import EngineDeadError, InvalidRequestError, QueueFullError
from .models.tokenizer import Tokenizer

log = logging.getLogger("neo_backend")

IDLE_WAIT_S = 0.05
STATUS_LOG_INTERVAL_S = 10.0


class RequestStream:
    """The outputs of one request, in order; the last one has `finished=True`. With `on_output` they are handed
    to that callable on the engine's loop thread instead (it must return quickly and not raise)."""

    def __init__(
        self, request_id: str, front: StreamingEngine, on_output: Callable[[RequestOutput], None] | None = None
    ) -> None:
        self.request_id = request_id
        self._front = front
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._on_output = on_output
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        (self._on_output or self._outputs.put)(output)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; raises TimeoutError if none arrives within `timeout` seconds."""
        try:
            out = self._outputs.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no output within {timeout} s") from None
        self.finished = out.finished
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    def cancel(self) -> None:
        self._front.abort(self.request_id)


class StreamingEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self._owns_engine = engine is None  # closed by `shutdown`
        self.engine = engine or LLMEngine(config)
        self.config = self.engine.config
        attention_cpus(self.config.engine_cpu)  # an engine_cpu this process may not use fails here
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._closed: str | None = None  # why new requests are refused, once every stream has been failed
        self.dead_reason: str | None = None
        self._last_log = (time.monotonic(), 0)  # (when, generation tokens then)
        self._stats = self.engine.stats_snapshot()
        self._thread = threading.Thread(target=self._loop, name="neo-engine-loop", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive() and self.engine.healthy

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict[str, Any]:
        """The engine's counters and gauges as of the loop's last step (safe from any thread)."""
        return self._stats

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> RequestStream:
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.dead_reason or self.engine.failure or 'stopped'}")
        waiting = len(self.engine.scheduler.waiting) + self._inbox.qsize()
        if waiting >= self.config.max_queue_size:
            raise QueueFullError(
                f"server is at capacity: {waiting} requests waiting "
                f"(max_queue_size={self.config.max_queue_size}); retry later"
            )
        seq = self.engine.make_sequence(prompt, params, request_id)
        stream = RequestStream(seq.request_id, self, on_output)
        with self._lock:
            if self._closed is not None:  # a submit racing shutdown: its stream would never be failed
                raise EngineDeadError(f"engine is not running: {self._closed}")
            if seq.request_id in self._streams:
                raise InvalidRequestError(f"request id {seq.request_id!r} is already in flight")
            self._streams[seq.request_id] = stream
        self._inbox.put(("add", seq))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; in-flight requests end with an error output rather than hanging. An engine this front
        built is closed (its worker ranks stop)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._fail_all("server is shutting down")
        if self._owns_engine:
            self.engine.close()

    def _loop(self) -> None:
        try:
            if self.config.engine_cpu is not None:
                pin_current_thread({self.config.engine_cpu}, "engine loop")
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._dispatch(self.engine.step())
                self._stats = self.engine.stats_snapshot()
                if time.monotonic() >= self._last_log[0] + STATUS_LOG_INTERVAL_S:
                    self._log_status()
        except Exception as exc:  # the loop must never die silently: fail every waiting client
            self.dead_reason = f"engine loop crashed: {type(exc).__name__}: {exc}"
            log.exception("engine loop crashed; failing %d in-flight requests", len(self._streams))
            self._fail_all(self.dead_reason)

    def _log_status(self) -> None:
        st = self._stats
        now, generated = time.monotonic(), st["generation_tokens"]
        rate = (generated - self._last_log[1]) / (now - self._last_log[0])
        self._last_log = (now, generated)
        log.info(
            "running %d GPU + %d CPU, waiting %d | KV blocks gpu %d/%d cpu %d/%d | %.1f tokens/s | modes %s",
            st["requests_gpu_decode"],
            st["requests_cpu_decode"],
            st["requests_waiting"],
            st["gpu_blocks_used"],
            st["gpu_blocks_total"],
            st["cpu_blocks_used"],
            st["cpu_blocks_total"],
            rate,
            st["modes"],
        )

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.engine.add_sequence(item)
            else:
                out = self.engine.abort(item)
                if out is not None:
                    self._dispatch([out])
                    self._stats = self.engine.stats_snapshot()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            self._closed = message
        for request_id, stream in streams.items():
            stream.put(RequestOutput(request_id, "", [], True, "error", 0, 0, 0.0, error=message))
