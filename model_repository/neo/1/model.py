"""Triton python-backend model `neo`: the NEO engine behind the Triton vLLM backend's interface.

One StreamingEngine per model instance. `execute` only validates and submits, then returns (a decoupled model
may answer later); the engine's loop thread hands each output to one sender thread, which forwards it through
that request's response sender, and one monitor thread polls every request for client cancellation every 20 ms
and refreshes the engine gauges. Every request gets exactly one response carrying the final flag, whatever happens to it.
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
import typing
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

from neo_backend.config import EngineConfig
from neo_backend.errors import EngineDeadError, InvalidRequestError, NeoError, QueueFullError
from neo_backend.outputs import RequestMetrics, RequestOutput
from neo_backend.sampling_params import SamplingParams
from neo_backend.streaming import StreamingEngine

log = logging.getLogger("neo_backend.triton")

CANCEL_POLL_S = 0.02
GAUGE_REFRESH_S = 0.25
SHUTDOWN_DRAIN_S = 5.0
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# Config parameters read by the python backend itself, not engine knobs.
BACKEND_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})
FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
               "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
SCALAR_SAMPLING_INPUTS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed",
                          "repetition_penalty", "presence_penalty", "frequency_penalty")
# Request parameters that Triton's own frontends and clients set (e.g. tritonclient's
# enable_empty_final_response); they are not sampling parameters.
RESERVED_PARAMETER_PREFIX = "triton_"
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "binary_data_output", "headers"})

SAMPLING_TYPES = {name: next((a for a in typing.get_args(hint) if a is not type(None)), hint)
                  for name, hint in typing.get_type_hints(SamplingParams).items()}

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0, 640.0]
PER_TOKEN_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]


# Requests -------------------------------------------------------------------------------------------------------

@dataclass
class RequestSpec:
    """What one Triton request asks for, validated; parsing errors are InvalidRequestError naming the input."""
    prompt: str
    sampling: dict[str, Any]
    stream: bool
    exclude_input: bool
    returns: frozenset[str]  # the optional outputs asked for, by output name

    @classmethod
    def parse(cls, request: Any) -> RequestSpec:
        prompt = _text_input(request)
        params = _json_object(request.parameters() or "{}", "the request parameters")
        params = {k: v for k, v in params.items()
                  if k not in RESERVED_PARAMETERS and not k.startswith(RESERVED_PARAMETER_PREFIX)}
        flags = {name: _flag(request, name, params.pop(name, None)) for name in FLAG_INPUTS}
        stream = bool(flags["stream"])
        exclude = flags["exclude_input_in_output"]
        if stream and exclude is False:
            raise InvalidRequestError("stream=true requires exclude_input_in_output=true: streamed responses carry "
                                      "only the new text")
        tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        sampling = params if tensor is None else _json_object(_single_string(tensor, "sampling_parameters"),
                                                              "sampling_parameters")
        sampling = {**_coerce_sampling(sampling), **_scalar_sampling_inputs(request)}
        returns = frozenset(name[len("return_"):] for name in FLAG_INPUTS if name.startswith("return_") and flags[name])
        # Like the vLLM backend: the prompt is prepended to a non-streamed answer unless excluded.
        return cls(prompt, sampling, stream, stream if exclude is None else exclude, returns)


def _text_input(request: Any) -> str:
    tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    if tensor is None:
        raise InvalidRequestError("missing input text_input (the prompt, STRING[1])")
    return _single_string(tensor, "text_input")


def _single_string(tensor: Any, name: str) -> str:
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one string, got {values.size}")
    return _utf8(values[0], name)


def _utf8(value: Any, name: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(f"{what} nests too deeply to be read") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _flag(request: Any, name: str, parameter: Any) -> bool | None:
    """A BOOL[1] input, or else the request parameter of the same name (as HTTP generate clients send it)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is not None:
        values = tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise InvalidRequestError(f"{name} must hold exactly one boolean, got {values.size}")
        return bool(values[0])
    if parameter is None or isinstance(parameter, bool):
        return parameter
    raise InvalidRequestError(f"request parameter {name} must be a boolean, got {parameter!r}")


def _coerce_sampling(values: Mapping[str, Any]) -> dict[str, Any]:
    """Accept numbers and booleans sent as strings, as vLLM-backend clients do ({"temperature": "0.1"})."""
    out = dict(values)
    for key, value in values.items():
        kind = SAMPLING_TYPES.get(key)
        if not isinstance(value, str) or kind not in (int, float, bool):
            continue
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false"):
                    raise ValueError
                out[key] = text == "true"
            else:
                out[key] = kind(text)
        except ValueError:
            raise InvalidRequestError(f"sampling parameter {key}={value!r} is not a valid {kind.__name__}") from None
    return out


def _scalar_sampling_inputs(request: Any) -> dict[str, Any]:
    """TensorRT-LLM style inputs (max_tokens INT32[1], temperature FP32[1], stop_words STRING[-1], ...)."""
    values: dict[str, Any] = {}
    for name in SCALAR_SAMPLING_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            array = tensor.as_numpy().reshape(-1)
            if array.size != 1:
                raise InvalidRequestError(f"{name} must hold exactly one value, got {array.size}")
            values[name] = array[0].item()
    tensor = pb_utils.get_input_tensor_by_name(request, "stop_words")
    if tensor is not None:
        values["stop"] = [_utf8(v, "stop_words") for v in tensor.as_numpy().reshape(-1)]
    return values


# Responses ------------------------------------------------------------------------------------------------------

class ResponseWriter:
    """Turns one request's engine outputs into responses: every delta when streaming, else one whole answer."""

    def __init__(self, spec: RequestSpec, decode: typing.Callable[[list[int]], str]) -> None:
        self.spec = spec
        self._decode = decode
        self._text: list[str] = [] if spec.exclude_input else [spec.prompt]
        self._logprobs: list[dict[int, float]] | None = None

    def add(self, out: RequestOutput) -> Any | None:
        """The response to send for this output, or None while a non-streamed answer is still growing."""
        if self.spec.stream:
            return self._response(out.text, len(out.token_ids), out.logprobs, out)
        self._text.append(out.text)
        if out.logprobs is not None:
            self._logprobs = (self._logprobs or []) + out.logprobs
        if not out.finished:
            return None
        return self._response("".join(self._text), out.num_output_tokens, self._logprobs, out)

    def _response(self, text: str, num_tokens: int, logprobs: list[dict[int, float]] | None,
                  out: RequestOutput) -> Any:
        returns = self.spec.returns
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if "finish_reason" in returns:
            reason = (out.finish_reason or "") if out.finished else ""
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)))
        if "cumulative_logprob" in returns:
            tensors.append(pb_utils.Tensor("cumulative_logprob",
                                           np.array([out.cumulative_logprob], dtype=np.float32)))
        if "logprobs" in returns:
            tensors.append(pb_utils.Tensor("logprobs", np.array([self._logprobs_json(logprobs).encode()],
                                                                dtype=np.object_)))
        if "num_input_tokens" in returns:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([out.num_prompt_tokens], dtype=np.uint32)))
        if "num_output_tokens" in returns:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([num_tokens], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _logprobs_json(self, logprobs: list[dict[int, float]] | None) -> str:
        """vLLM backend format: per token, {token id: {"logprob", "decoded_token"}}, the sampled token first."""
        if logprobs is None:
            return "null"
        return json.dumps([{str(tid): {"logprob": lp, "decoded_token": self._decode([tid])} for tid, lp in entry.items()}
                           for entry in logprobs])


def _error_response(message: str, code: int) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


# Metrics --------------------------------------------------------------------------------------------------------

class NeoMetrics:
    """Triton custom metrics: request latency histograms, engine counters (as deltas of stats_snapshot) and gauges.

    `record` and `count_failure` only queue; `flush` and `refresh` touch the metrics and must run on one thread:
    metric updates from many threads at once crashed the 2.51 python backend (SIGSEGV in the server while it
    read a metric message).
    """

    HISTOGRAMS = {  # metric name -> (RequestMetrics attribute, description, buckets)
        "neo_time_to_first_token_seconds": ("time_to_first_token", "Time from arrival to the first output token",
                                            LATENCY_BUCKETS),
        "neo_time_per_output_token_seconds": ("time_per_output_token", "Mean time between output tokens",
                                              PER_TOKEN_BUCKETS),
        "neo_e2e_request_latency_seconds": ("e2e_latency", "Time from arrival to the last output", LATENCY_BUCKETS),
        "neo_request_queue_time_seconds": ("queue_time", "Time from arrival to the first schedule", LATENCY_BUCKETS),
    }
    COUNTERS = {  # (metric name, label) -> stats_snapshot key
        ("neo_prompt_tokens_total", ()): "prompt_tokens",
        ("neo_generation_tokens_total", ()): "generation_tokens",
        ("neo_preemptions_total", ()): "preemptions",
        ("neo_swapped_blocks_total", ("direction", "out")): "swap_out_blocks",
        ("neo_swapped_blocks_total", ("direction", "in")): "swap_in_blocks",
    }
    GAUGES = {
        ("neo_requests", ("state", "waiting")): "requests_waiting",
        ("neo_requests", ("state", "gpu_decode")): "requests_gpu_decode",
        ("neo_requests", ("state", "cpu_decode")): "requests_cpu_decode",
        ("neo_kv_blocks_used", ("pool", "gpu")): "gpu_blocks_used",
        ("neo_kv_blocks_used", ("pool", "cpu")): "cpu_blocks_used",
        ("neo_kv_blocks_total", ("pool", "gpu")): "gpu_blocks_total",
        ("neo_kv_blocks_total", ("pool", "cpu")): "cpu_blocks_total",
    }
    DESCRIPTIONS = {
        "neo_prompt_tokens_total": "Prompt tokens prefilled",
        "neo_generation_tokens_total": "Output tokens generated",
        "neo_preemptions_total": "Requests preempted for lack of KV blocks",
        "neo_swapped_blocks_total": "KV blocks moved between the GPU and CPU pools",
        "neo_request_failures_total": "Requests that failed, by reason",
        "neo_requests": "Requests in the engine, by state",
        "neo_kv_blocks_used": "KV cache blocks in use, by pool",
        "neo_kv_blocks_total": "KV cache blocks, by pool",
    }

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._labels = dict(labels)
        self._families: dict[str, Any] = {}  # kept alive for as long as their metrics
        self._histograms = {attr: self._family(name, description, pb_utils.MetricFamily.HISTOGRAM).Metric(
            labels=self._labels, buckets=buckets) for name, (attr, description, buckets) in self.HISTOGRAMS.items()}
        self._counters = {key: self._metric(*key, pb_utils.MetricFamily.COUNTER) for key in self.COUNTERS}
        self._gauges = {key: self._metric(*key, pb_utils.MetricFamily.GAUGE) for key in self.GAUGES}
        self._failures: dict[str, Any] = {}
        self._last: dict[str, int] = {}
        self._pending: queue.SimpleQueue[RequestMetrics | str] = queue.SimpleQueue()

    def _family(self, name: str, description: str, kind: Any) -> Any:
        if name not in self._families:
            self._families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        return self._families[name]

    def _metric(self, name: str, label: tuple[str, ...], kind: Any) -> Any:
        labels = {**self._labels, **dict([label] if label else [])}
        return self._family(name, self.DESCRIPTIONS[name], kind).Metric(labels=labels)

    def record(self, metrics: RequestMetrics) -> None:
        """Queue a finished request's latencies for the histograms."""
        self._pending.put(metrics)

    def count_failure(self, reason: str) -> None:
        """Queue one failure of a request refused before it reached the engine."""
        self._pending.put(reason)

    def flush(self) -> None:
        while True:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):
                self._increment_failures(item, 1)
                continue
            for attr, histogram in self._histograms.items():
                value = getattr(item, attr)
                if value is not None:
                    histogram.observe(value)

    def _increment_failures(self, reason: str, n: int) -> None:
        if reason not in self._failures:
            self._failures[reason] = self._metric("neo_request_failures_total", ("reason", reason),
                                                  pb_utils.MetricFamily.COUNTER)
        self._failures[reason].increment(n)

    def refresh(self, snapshot: Mapping[str, Any]) -> None:
        for key, stat in self.COUNTERS.items():
            self._increment_to(stat, snapshot.get(stat, 0), self._counters[key])
        for reason, total in snapshot.get("failures", {}).items():
            delta = total - self._last.get("failures/" + reason, 0)
            if delta > 0:
                self._last["failures/" + reason] = total
                self._increment_failures(reason, delta)
        for key, stat in self.GAUGES.items():
            self._gauges[key].set(snapshot.get(stat, 0))

    def _increment_to(self, stat: str, total: int, counter: Any) -> None:
        delta = total - self._last.get(stat, 0)
        if delta > 0:
            self._last[stat] = total
            counter.increment(delta)


# The model ------------------------------------------------------------------------------------------------------

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
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model_config = json.loads(args["model_config"])
        config = engine_config(model_config.get("parameters", {}))
        name, version = args["model_name"], args["model_version"]
        log.info("model %s v%s: loading the engine (%s)", name, version, _describe(config))
        start = time.monotonic()
        self.engine = StreamingEngine(config)
        stats = self.engine.stats()
        log.info("model %s v%s: engine loaded in %.1f s; KV pools: gpu %d blocks, cpu %d blocks of %d tokens; "
                 "max_model_len %d", name, version, time.monotonic() - start, stats["gpu_blocks_total"],
                 stats.get("cpu_blocks_total", 0), config.block_size, self.engine.engine.max_model_len)
        self.metrics = NeoMetrics({"model": name, "version": version})
        self.metrics.refresh(stats)
        self._in_flight: dict[str, _InFlight] = {}
        self._outbox: queue.SimpleQueue[tuple[_InFlight, RequestOutput] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="neo-sender", daemon=True)
        self._sender.start()
        self._stopping = threading.Event()
        self._wakeup_fd: int | None = None
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

        threading.Thread(target=watch, name="neo-sigterm", daemon=True).start()

    def is_ready(self) -> bool:
        """Model readiness for Triton releases whose python backend asks the model (python_backend PR #430);
        the bundled 2.51 does not, and there a dead engine answers every request with UNAVAILABLE instead."""
        return self.engine.healthy

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._start(request)
        return None

    def finalize(self) -> None:
        """Stop the engine: requests still in flight end with an error response, then the senders drain."""
        log.info("shutting down with %d requests in flight", len(self._in_flight))
        self._stopping.set()
        self.engine.shutdown()
        if self._wakeup_fd is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)  # before the close: a later signal must not write into a reused fd
            os.close(self._wakeup_fd)  # ends the watcher thread
        self._outbox.put(None)  # after the engine's final outputs: the sender drains them, then stops
        self._sender.join(SHUTDOWN_DRAIN_S)
        self._monitor.join(1.0)
        log.info("engine stopped")

    def _start(self, request: Any) -> None:
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        try:
            spec = RequestSpec.parse(request)
            in_flight = _InFlight(spec, sender, request_id, ResponseWriter(spec, self.engine.engine.tokenizer.decode))
            self._in_flight[request_id] = in_flight
            self.engine.submit(spec.prompt, spec.sampling, request_id=request_id,
                               on_output=lambda out: self._outbox.put((in_flight, out)))
        except NeoError as exc:
            self._in_flight.pop(request_id, None)
            reason, code = _rejection(exc)
            self.metrics.count_failure(reason)
            _send_quietly(sender, _error_response(str(exc), code), FINAL)
        except Exception as exc:  # a bug must still answer the request
            self._in_flight.pop(request_id, None)
            log.exception("request rejected by an internal error")
            self.metrics.count_failure("internal")
            _send_quietly(sender, _error_response(f"internal error: {type(exc).__name__}: {exc}",
                                                  pb_utils.TritonError.INTERNAL), FINAL)

    def _send_loop(self) -> None:
        """The one thread that turns engine outputs into responses, for every request, in order."""
        while (item := self._outbox.get()) is not None:
            request, out = item
            try:
                if out.finished:
                    self._complete(request, self._final_response(request, request.writer, out))
                elif (response := request.writer.add(out)) is not None:
                    self._send(request, response)
            except Exception as exc:
                log.exception("request %s: sending its outputs failed", request.request_id)
                self.engine.abort(request.request_id)
                self._complete(request, _error_response(f"internal error: {exc}", pb_utils.TritonError.INTERNAL))

    def _final_response(self, request: _InFlight, writer: ResponseWriter, out: RequestOutput) -> Any:
        if out.metrics is not None:
            self.metrics.record(out.metrics)
        if out.error is not None:
            code = pb_utils.TritonError.UNAVAILABLE if self._stopping.is_set() else pb_utils.TritonError.INTERNAL
            return _error_response(out.error, code)
        if out.finish_reason == "abort":
            return _error_response("request cancelled", pb_utils.TritonError.CANCELLED)
        return writer.add(out)

    def _send(self, request: _InFlight, response: Any) -> None:
        """Send a delta; a client that went away is treated as a cancellation (the engine frees its blocks)."""
        if not _send_quietly(request.sender, response, 0) and not request.cancelled:
            request.cancelled = True
            self.engine.abort(request.request_id)

    def _complete(self, request: _InFlight, response: Any) -> None:
        self._in_flight.pop(request.request_id, None)
        with request.lock:
            if not request.completed:
                request.completed = True
                _send_quietly(request.sender, response, FINAL)

    def _monitor_loop(self) -> None:
        next_refresh = 0.0
        while not self._stopping.wait(CANCEL_POLL_S):
            for request_id, request in list(self._in_flight.items()):
                with request.lock:
                    cancelled = not (request.cancelled or request.completed) and _is_cancelled(request.sender)
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


def engine_config(parameters: Mapping[str, Mapping[str, str]]) -> EngineConfig:
    """EngineConfig from config.pbtxt `parameters`; unknown or malformed ones fail the model load, named."""
    values = {key: value.get("string_value", "") for key, value in parameters.items() if key not in BACKEND_PARAMETERS}
    return EngineConfig.from_strings(values, source="config.pbtxt parameter")


def _describe(config: EngineConfig) -> str:
    defaults = EngineConfig()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(defaults, f.name)}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "all defaults"


def _rejection(exc: NeoError) -> tuple[str, int]:
    """Failure-metric reason and Triton error code of a request refused before it reached the engine."""
    if isinstance(exc, QueueFullError):
        return "queue_full", pb_utils.TritonError.UNAVAILABLE
    if isinstance(exc, EngineDeadError):
        return "engine_dead", pb_utils.TritonError.UNAVAILABLE
    if isinstance(exc, InvalidRequestError):
        return "invalid_request", pb_utils.TritonError.INVALID_ARG
    return "rejected", pb_utils.TritonError.INTERNAL


def _send_quietly(sender: Any, response: Any, flags: int) -> bool:
    try:
        sender.send(response, flags=flags)
        return True
    except Exception as exc:  # the client is gone or the request already completed
        log.debug("response not delivered: %s", exc)
        return False


def _is_cancelled(sender: Any) -> bool:
    try:
        return sender.is_cancelled()
    except Exception:  # a check that fails (the server is stopping) is no cancellation
        return False
