"""The wire format shared by the sync and asyncio clients: Triton vLLM-backend tensor names.

A request carries `text_input`, `stream`, `sampling_parameters` (vLLM SamplingParams names as JSON),
`exclude_input_in_output` and the `return_*` flags; each streamed response carries a `text_output` delta and,
on the last one, `finish_reason`. `num_output_tokens` is per response (the delta's token count), as in the
vLLM backend, so the client sums it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.grpc import InferInput, InferResult
from tritonclient.utils import InferenceServerException

from .errors import ClientError, ModelNotFoundError, RequestTimeoutError, ServerError, ServerUnreachableError

DEFAULT_MODEL = "neo"
DEFAULT_TIMEOUT_S = 120.0
_RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


def default_url() -> str:
    """The gRPC address `make serve` listens on, from the same NEO_HOST / NEO_GRPC_PORT variables."""
    host = os.environ.get("NEO_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):  # a bind-all address is not one to connect to
        host = "127.0.0.1"
    return f"{host}:{os.environ.get('NEO_GRPC_PORT') or 8001}"


def raw_inputs(prompt: bytes, sampling: bytes | None, stream: bool = True) -> list[InferInput]:
    """The tensors of a request whose prompt and sampling JSON are sent as given, valid UTF-8 and JSON or not."""
    inputs = [
        _tensor("text_input", "BYTES", prompt),
        _tensor("stream", "BOOL", stream),
        _tensor("exclude_input_in_output", "BOOL", True),
    ]
    if sampling is not None:
        inputs.append(_tensor("sampling_parameters", "BYTES", sampling))
    return inputs


def build_inputs(prompt: str, sampling: Mapping[str, Any] | None) -> list[InferInput]:
    """The request tensors for one streaming generation, asking for the counts a `GenerationResult` reports."""
    inputs = raw_inputs(prompt.encode("utf-8"), json.dumps(dict(sampling or {})).encode("utf-8"))
    inputs += [_tensor(flag, "BOOL", True) for flag in _RETURN_FLAGS]
    if (sampling or {}).get("logprobs") is not None:
        inputs.append(_tensor("return_logprobs", "BOOL", True))
    return inputs


def _tensor(name: str, datatype: str, value: Any) -> InferInput:
    array = np.array([value], dtype=np.object_ if datatype == "BYTES" else bool)
    inp = InferInput(name, [1], datatype)
    inp.set_data_from_numpy(array)
    return inp


@dataclass(frozen=True)
class Delta:
    """One streamed response: its new text and, when the request asked for logprobs, those of its tokens in the
    vLLM backend's format (per token, {token id: {"logprob", "decoded_token"}}, the sampled token first)."""

    text: str
    logprobs: list[dict[str, dict[str, Any]]] | None = None


@dataclass
class GenerationResult:
    """The outcome of one request. Times are `time.perf_counter()` seconds."""

    request_id: str
    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int
    start_time: float
    first_token_time: float | None
    end_time: float
    response_times: list[float] = field(default_factory=list, repr=False)

    @property
    def ttft(self) -> float | None:
        """Time to first token: request sent to first non-empty delta."""
        return None if self.first_token_time is None else self.first_token_time - self.start_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.start_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM benchmark definition)."""
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.end_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.e2e if self.e2e > 0 else 0.0

    def stats_line(self) -> str:
        ttft = "n/a" if self.ttft is None else f"{self.ttft * 1000:.1f} ms"
        tpot = "n/a" if self.tpot is None else f"{self.tpot * 1000:.1f} ms"
        return (
            f"TTFT {ttft} | TPOT {tpot} | {self.tokens_per_second:.1f} tokens/s | "
            f"{self.num_output_tokens} tokens in {self.e2e:.2f} s | finish_reason {self.finish_reason}"
        )


class ResponseAccumulator:
    """Folds streamed responses into text deltas and, at the end, a `GenerationResult`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.start_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.response_times: list[float] = []
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.num_input_tokens: int | None = None
        self.num_output_tokens = 0
        self.saw_token_counts = False
        self.done = False

    def feed(self, result: InferResult, arrival: float) -> Delta:
        """Record one response; return its delta. Sets `done` on the request's last response."""
        final_param = result.get_response().parameters.get("triton_final_response")
        delta = _first_string(result, "text_output") or ""
        logprobs = _first_string(result, "logprobs")
        reason = _first_string(result, "finish_reason")
        n_in = result.as_numpy("num_input_tokens")
        n_out = result.as_numpy("num_output_tokens")
        if n_in is not None and n_in.size:
            self.num_input_tokens = int(n_in.reshape(-1)[0])
        if n_out is not None and n_out.size:
            self.saw_token_counts = True
            self.num_output_tokens += int(n_out.reshape(-1)[0])
        elif delta and not self.saw_token_counts:
            self.num_output_tokens += 1  # a server without token counts: one response per token, roughly
        if delta:
            self.parts.append(delta)
            self.response_times.append(arrival)
            if self.first_token_time is None:
                self.first_token_time = arrival
        if reason:
            self.finish_reason = reason
        # Servers that honour enable_empty_final_response flag the last response; the asyncio client cannot
        # ask for that flag, so a finish reason (always requested) marks the end as well.
        self.done = bool(final_param and final_param.bool_param) or bool(reason)
        return Delta(delta, None if logprobs is None else json.loads(logprobs))

    def result(self, end_time: float) -> GenerationResult:
        return GenerationResult(
            request_id=self.request_id,
            text="".join(self.parts),
            finish_reason=self.finish_reason,
            num_input_tokens=self.num_input_tokens,
            num_output_tokens=self.num_output_tokens,
            start_time=self.start_time,
            first_token_time=self.first_token_time,
            end_time=end_time,
            response_times=self.response_times,
        )


def _first_string(result: InferResult, name: str) -> str | None:
    array = result.as_numpy(name)
    if array is None or not array.size:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def model_not_ready(url: str, model: str, repository_index: Mapping[str, Any]) -> ModelNotFoundError:
    """The error for a model that `is_model_ready` denied, telling a missing model from one still loading."""
    models = {m["name"]: m.get("state", "") for m in repository_index.get("models", [])}
    if model in models:
        return ModelNotFoundError(
            f"model {model!r} on {url} is not ready (state {models[model] or 'unknown'}); "
            "wait for it to finish loading, or read the server log"
        )
    served = ", ".join(sorted(models)) or "none"
    return ModelNotFoundError(f"{url} does not serve model {model!r} (it serves: {served}); check the model name")


def translate_error(exc: InferenceServerException, url: str, model: str, timeout: float) -> ClientError:
    """Map a tritonclient exception to the typed error a user can act on."""
    status = str(exc.status() or "")
    message = exc.message() or str(exc)
    if "UNAVAILABLE" in status:
        return ServerUnreachableError(
            f"cannot reach a Triton gRPC endpoint at {url} ({message}); "
            "start the server (make serve) or pass --url host:port"
        )
    if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in message:
        return RequestTimeoutError(
            f"request to {url} did not complete within {timeout:g} s; raise --timeout or lower --max-tokens"
        )
    if "unknown model" in message or "NOT_FOUND" in status:
        return ModelNotFoundError(f"{url} does not serve model {model!r} ({message}); check --model")
    return ServerError(f"server error from {url} for model {model!r}: {message}", server_message=message)
