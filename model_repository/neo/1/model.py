"""Triton python-backend model `neo`: the NEO engine behind the Triton vLLM backend's interface.

One StreamingEngine per model instance. `execute` only validates and submits, then returns (a decoupled model
may answer later); the engine's loop thread hands each output to one sender thread, which forwards it through
that request's response sender, and one monitor thread polls every request for client cancellation every 20 ms
and refreshes the engine gauges. Every request gets exactly one response carrying the final flag, whatever happens
to it. Parsing requests, shaping responses and the metrics live in `neo_backend.triton`; this file holds the
lifecycle.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import uuid
from typing import Any

import triton_python_backend_utils as pb_utils

from neo_backend.core.outputs import RequestOutput
from neo_backend.errors import NeoError
from neo_backend.streaming import StreamingEngine
from neo_backend.triton.metrics import NeoMetrics
from neo_backend.triton.parameters import engine_config
from neo_backend.triton.request import RequestSpec
from neo_backend.triton.responses import (
    ErrorCode,
    InFlight,
    Outputs,
    ResponseWriter,
    is_cancelled,
    rejection,
    send_quietly,
)
from neo_backend.triton.sigterm import SigtermWatcher

log = logging.getLogger("neo_backend.triton")

CANCEL_POLL_S = 0.02
GAUGE_REFRESH_S = 0.25
SHUTDOWN_DRAIN_S = 5.0
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
        self.engine = StreamingEngine(config)  # logs its pools, policy and limits
        log.info("model %s v%s: engine loaded in %.1f s", name, version, time.monotonic() - start)
        self.metrics = NeoMetrics({"model": name, "version": version}, pb_utils.MetricFamily)
        self.metrics.refresh(self.engine.stats())
        self._in_flight: dict[str, InFlight] = {}
        self._outbox: queue.SimpleQueue[tuple[InFlight, RequestOutput] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="neo-sender", daemon=True)
        self._sender.start()
        self._stopping = threading.Event()
        self._watcher = SigtermWatcher(self._on_sigterm)
        self._monitor = threading.Thread(target=self._monitor_loop, name="neo-monitor", daemon=True)
        self._monitor.start()
        if not self._watcher.start():
            log.warning("initialize is not on the stub's main thread: SIGTERM will not end in-flight streams early")
        log.info("model %s v%s: ready", name, version)

    def _on_sigterm(self) -> None:
        if not self._stopping.is_set():
            log.info("SIGTERM: ending %d in-flight requests", len(self._in_flight))
            self._stopping.set()
            self.engine.shutdown()

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

        Every thread of the model is joined, and the metrics deleted, before this returns: the stub tears down and
        finalizes Python next. A thread still holding the model then frees the engine's tensors during interpreter
        shutdown, where torch, taking the GIL back in a tensor's destructor, ends that thread by an unwind that
        aborts the stub; a metric deleted then crashes the stub (`NeoMetrics.close`).
        """
        log.info("shutting down with %d requests in flight", len(self._in_flight))
        self._stopping.set()
        self.engine.shutdown()
        self._watcher.stop()
        self._outbox.put(None)  # after the engine's final outputs: the sender drains them, then stops
        for thread, timeout in ((self._sender, SHUTDOWN_DRAIN_S), (self._monitor, 1.0), (self._watcher.thread, 1.0)):
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    log.warning("thread %s still running after %.0f s", thread.name, timeout)
        self.metrics.close()
        log.info("engine stopped")

    def _start(self, request: Any) -> None:
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        try:
            spec = RequestSpec.parse(request)
            in_flight = InFlight(spec, sender, request_id, ResponseWriter(spec, self.engine.tokenizer.decode))
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

    def _send(self, request: InFlight, response: Any) -> None:
        """Send a delta; a client that went away is treated as a cancellation (the engine frees its blocks)."""
        if not send_quietly(request.sender, response, 0) and not request.cancelled:
            request.cancelled = True
            self.engine.abort(request.request_id)

    def _complete(self, request: InFlight, response: Any) -> None:
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
