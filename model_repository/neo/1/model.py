"""Triton python-backend model `neo`: the NEO engine behind the Triton vLLM backend's interface.

One StreamingEngine per model instance. `execute` only validates and submits, then returns (a decoupled model
may answer later); the engine's loop thread hands each output to one sender thread, which forwards it through
that request's response sender, and one monitor thread polls every request for client cancellation every 20 ms
and refreshes the engine gauges. Every request gets exactly one response carrying the final flag, whatever happens
to it. Parsing requests, shaping responses and the metrics live in `neo_backend.triton`; this file holds the
lifecycle.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import triton_python_backend_utils as pb_utils

from neo_backend.core.outputs import RequestOutput
from neo_backend.errors import NeoError
from neo_backend.streaming import StreamingEngine
from neo_backend.triton.metrics import NeoMetrics
from neo_backend.triton.parameters import engine_config
from neo_backend.triton.request import RequestSpec
from neo_backend.triton.responses import ErrorCode, Outputs, ResponseWriter, is_cancelled, rejection, send_quietly

log = logging.getLogger("neo_backend.triton")

CANCEL_POLL_S = 0.02
GAUGE_REFRESH_S = 0.25
SHUTDOWN_DRAIN_S = 5.0
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class _InFlight:
    spec: RequestSpec
    sender: Any
    request_id: str
    writer: ResponseWriter
    cancelled: bool = False
    completed: bool = False  # the final response went out; the sender must not be touched again
    # Serializes the final send with the monitor's is_cancelled(): asking a completed request's sender crashes
    # the server (its response factory is gone).
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        model_config = json.loads(args["model_config"])
        config = engine_config(model_config.get("parameters", {}))
        name, version = args["model_name"], args["model_version"]
        changed = ", ".join(f"{k}={v}" for k, v in config.changed_knobs().items())
        log.info("model %s v%s: loading the engine (%s)", name, version, changed or "all defaults")
        start = time.monotonic()
        self.engine = StreamingEngine(config)
        stats = self.engine.stats()
        log.info(
            "model %s v%s: engine loaded in %.1f s; KV pools: gpu %d blocks, cpu %d blocks of %d tokens; "
            "max_model_len %d",
            name,
            version,
            time.monotonic() - start,
            stats["gpu_blocks_total"],
            stats.get("cpu_blocks_total", 0),
            config.block_size,
            self.engine.max_model_len,
        )
        self.metrics = NeoMetrics({"model": name, "version": version}, pb_utils.MetricFamily)
        self.metrics.refresh(stats)
        self._in_flight: dict[str, _InFlight] = {}
        self._outbox: queue.SimpleQueue[tuple[_InFlight, RequestOutput] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="neo-sender", daemon=True)
        self._sender.start()
        self._stopping = threading.Event()
        self._wakeup_fd: int | None = None
        self._watcher: threading.Thread | None = None
        self._monitor = threading.Thread(target=self._monitor_loop, name="neo-monitor", daemon=True)
        self._monitor.start()
        self._watch_sigterm()
        log.info("model %s v%s: ready", name, version)

    def _watch_sigterm(self) -> None:
        """End every stream with an error as soon as this stub gets SIGTERM.

        Triton calls finalize only after in-flight requests are done, so on its own a server stopping with long
        streams waits out its exit timeout and then exits abruptly. `neo_backend serve` signals the server's process
        group, stub included. The Python-level handler would only run once the stub's main thread next runs Python
        code, so the signal is taken from the interpreter's wakeup fd by a thread instead.
        """
        if threading.current_thread() is not threading.main_thread():
            log.warning("initialize is not on the stub's main thread: SIGTERM will not end in-flight streams early")
            return
        read_fd, self._wakeup_fd = os.pipe()
        os.set_blocking(self._wakeup_fd, False)
        signal.signal(signal.SIGTERM, lambda _signum, _frame: None)  # the work happens on the watcher thread
        signal.set_wakeup_fd(self._wakeup_fd, warn_on_full_buffer=False)

        def watch() -> None:
            with os.fdopen(read_fd, "rb", buffering=0) as signals:
                while byte := signals.read(1):
                    if byte[0] == signal.SIGTERM and not self._stopping.is_set():
                        log.info("SIGTERM: ending %d in-flight requests", len(self._in_flight))
                        self._stopping.set()
                        self.engine.shutdown()

        self._watcher = threading.Thread(target=watch, name="neo-sigterm", daemon=True)
        self._watcher.start()

    def is_ready(self) -> bool:
        """Model readiness for Triton releases whose python backend asks the model (python_backend PR #430);
        the bundled 2.51 does not, and there a dead engine answers every request with UNAVAILABLE instead."""
        return self.engine.healthy

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._start(request)
        return None

    def finalize(self) -> None:
        """Stop the engine: requests still in flight end with an error response, then the senders drain.

        Every thread of the model is joined before this returns. The stub finalizes Python next; a thread still
        holding the model then would free the engine's tensors during interpreter shutdown, and torch, taking the
        GIL back in a tensor's destructor, ends that thread by an unwind that aborts the stub.
        """
        log.info("shutting down with %d requests in flight", len(self._in_flight))
        self._stopping.set()
        self.engine.shutdown()
        if self._wakeup_fd is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)  # before the close: a later signal must not write into a reused fd
            os.close(self._wakeup_fd)  # ends the watcher thread
        self._outbox.put(None)  # after the engine's final outputs: the sender drains them, then stops
        for thread, timeout in ((self._sender, SHUTDOWN_DRAIN_S), (self._monitor, 1.0), (self._watcher, 1.0)):
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    log.warning("thread %s still running after %.0f s", thread.name, timeout)
        log.info("engine stopped")

    def _start(self, request: Any) -> None:
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        try:
            spec = RequestSpec.parse(request)
            in_flight = _InFlight(spec, sender, request_id, ResponseWriter(spec, self.engine.tokenizer.decode))
            self._in_flight[request_id] = in_flight
            self.engine.submit(
                spec.prompt,
                spec.sampling,
                request_id=request_id,
                on_output=lambda out: self._outbox.put((in_flight, out)),
            )
        except NeoError as exc:
            self._in_flight.pop(request_id, None)
            reason, code = rejection(exc)
            self.metrics.count_failure(reason)
            send_quietly(sender, _error_response(str(exc), code), FINAL)
        except Exception as exc:  # a bug must still answer the request
            self._in_flight.pop(request_id, None)
            log.exception("request rejected by an internal error")
            self.metrics.count_failure("internal")
            send_quietly(
                sender, _error_response(f"internal error: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL), FINAL
            )

    def _send_loop(self) -> None:
        """The one thread that turns engine outputs into responses, for every request, in order."""
        while (item := self._outbox.get()) is not None:
            request, out = item
            try:
                if out.finished:
                    self._complete(request, self._final_response(request.writer, out))
                elif (outputs := request.writer.add(out)) is not None:
                    self._send(request, _response(outputs))
            except Exception as exc:
                log.exception("request %s: sending its outputs failed", request.request_id)
                self.engine.abort(request.request_id)
                self._complete(request, _error_response(f"internal error: {exc}", ErrorCode.INTERNAL))

    def _final_response(self, writer: ResponseWriter, out: RequestOutput) -> Any:
        if out.metrics is not None:
            self.metrics.record(out.metrics)
        if out.error is not None:
            return _error_response(out.error, ErrorCode.UNAVAILABLE if self._stopping.is_set() else ErrorCode.INTERNAL)
        if out.finish_reason == "abort":
            return _error_response("request cancelled", ErrorCode.CANCELLED)
        return _response(writer.add(out))

    def _send(self, request: _InFlight, response: Any) -> None:
        """Send a delta; a client that went away is treated as a cancellation (the engine frees its blocks)."""
        if not send_quietly(request.sender, response, 0) and not request.cancelled:
            request.cancelled = True
            self.engine.abort(request.request_id)

    def _complete(self, request: _InFlight, response: Any) -> None:
        self._in_flight.pop(request.request_id, None)
        with request.lock:
            if not request.completed:
                request.completed = True
                send_quietly(request.sender, response, FINAL)

    def _monitor_loop(self) -> None:
        next_refresh = 0.0
        while not self._stopping.wait(CANCEL_POLL_S):
            for request_id, request in list(self._in_flight.items()):
                with request.lock:
                    cancelled = not (request.cancelled or request.completed) and is_cancelled(request.sender)
                if cancelled:
                    request.cancelled = True
                    log.info("request %s cancelled by its client", request_id)
                    self.engine.abort(request_id)
            try:
                self.metrics.flush()
                if time.monotonic() >= next_refresh:
                    self.metrics.refresh(self.engine.stats())
                    next_refresh = time.monotonic() + GAUGE_REFRESH_S
            except Exception:
                log.exception("metrics update failed")


def _response(outputs: Outputs) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()])


def _error_response(message: str, code: ErrorCode) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[], error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code.name))
    )
