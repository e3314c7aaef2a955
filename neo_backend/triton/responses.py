"""The responses of one request, as the vLLM backend shapes them (named numpy arrays, error codes by name), and
sending them through a response sender whose client may be gone.

model.py wraps them into `pb_utils.InferenceResponse`s; kept plain arrays, tests can read them directly.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.outputs import RequestOutput
from ..errors import EngineDeadError, InvalidRequestError, NeoError, QueueFullError
from .request import RequestSpec

log = logging.getLogger("neo_backend.triton")

Outputs = dict[str, np.ndarray]  # output name -> array, in the order they are sent


class ErrorCode(enum.Enum):
    """The `pb_utils.TritonError` codes this model answers with, named as there."""

    INTERNAL = enum.auto()
    INVALID_ARG = enum.auto()
    UNAVAILABLE = enum.auto()
    CANCELLED = enum.auto()


class ResponseWriter:
    """Turns one request's engine outputs into responses: every delta when streaming, else one whole answer."""

    def __init__(self, spec: RequestSpec, decode: Callable[[list[int]], str]) -> None:
        self.spec = spec
        self._decode = decode
        self._text: list[str] = [] if spec.exclude_input else [spec.prompt]
        self._logprobs: list[dict[int, float]] | None = None

    def add(self, out: RequestOutput) -> Outputs | None:
        """The response to send for this output, or None while a non-streamed answer is still growing."""
        if self.spec.stream:
            return self._outputs(out.text, len(out.token_ids), out.logprobs, out)
        self._text.append(out.text)
        if out.logprobs is not None:
            self._logprobs = (self._logprobs or []) + out.logprobs
        if not out.finished:
            return None
        return self._outputs("".join(self._text), out.num_output_tokens, self._logprobs, out)

    def _outputs(
        self, text: str, num_tokens: int, logprobs: list[dict[int, float]] | None, out: RequestOutput
    ) -> Outputs:
        returns = self.spec.returns
        outputs = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        if "finish_reason" in returns:
            reason = (out.finish_reason or "") if out.finished else ""
            outputs["finish_reason"] = np.array([reason.encode()], dtype=np.object_)
        if "cumulative_logprob" in returns:
            outputs["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
        if "logprobs" in returns:
            outputs["logprobs"] = np.array([self._logprobs_json(logprobs).encode()], dtype=np.object_)
        if "num_input_tokens" in returns:
            outputs["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
        if "num_output_tokens" in returns:
            outputs["num_output_tokens"] = np.array([num_tokens], dtype=np.uint32)
        return outputs

    def _logprobs_json(self, logprobs: list[dict[int, float]] | None) -> str:
        """vLLM backend format: per token, {token id: {"logprob", "decoded_token"}}, the sampled token first."""
        if logprobs is None:
            return "null"
        return json.dumps(
            [
                {str(tid): {"logprob": lp, "decoded_token": self._decode([tid])} for tid, lp in entry.items()}
                for entry in logprobs
            ]
        )


@dataclass
class InFlight:
    """A request the model has accepted: what answers it and whether its final response went out."""

    spec: RequestSpec
    sender: Any
    request_id: str
    writer: ResponseWriter
    cancelled: bool = False
    completed: bool = False  # the final response went out; the sender must not be touched again
    # Serializes the final send with the monitor's is_cancelled(): asking a completed request's sender crashes
    # the server (its response factory is gone).
    lock: threading.Lock = field(default_factory=threading.Lock)


def rejection(exc: NeoError) -> tuple[str, ErrorCode]:
    """Failure-metric reason and error code of a request refused before it reached the engine."""
    if isinstance(exc, QueueFullError):
        return "queue_full", ErrorCode.UNAVAILABLE
    if isinstance(exc, EngineDeadError):
        return "engine_dead", ErrorCode.UNAVAILABLE
    if isinstance(exc, InvalidRequestError):
        return "invalid_request", ErrorCode.INVALID_ARG
    return "rejected", ErrorCode.INTERNAL


def send_quietly(sender: Any, response: Any, flags: int) -> bool:
    try:
        sender.send(response, flags=flags)
        return True
    except Exception as exc:  # the client is gone or the request already completed
        log.debug("response not delivered: %s", exc)
        return False


def is_cancelled(sender: Any) -> bool:
    try:
        return sender.is_cancelled()
    except Exception:  # a check that fails (the server is stopping) is no cancellation
        return False
