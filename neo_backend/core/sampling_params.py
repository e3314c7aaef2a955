"""Per-request sampling parameters, with vLLM's names, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import parse_knob
from ..errors import InvalidRequestError

_INT_FIELDS = {"max_tokens", "min_tokens", "top_k", "seed", "logprobs"}
_FLOAT_FIELDS = {"temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; N: the sampled token's logprob plus the N most likely

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be a finite number >= 0, got {self.temperature}",
            ),
            (self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                math.isfinite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                math.isfinite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs"):
                continue
            if isinstance(value, float) and value.is_integer():
                value = int(value)
                setattr(self, name, value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequestError(f"{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the request's tokens so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON-like mapping; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    @classmethod
    def parse_strings(cls, values: Mapping[str, Any], source: str = "sampling parameter") -> dict[str, Any]:
        """`values` with numbers and booleans sent as strings parsed by the knob rules (`parse_knob`), as
        vLLM-backend clients send them ({"temperature": "0.1"}); everything else is left to validation."""
        return {
            key: parse_knob(key, value, _SCALAR_HINTS[key], source, InvalidRequestError)
            if isinstance(value, str) and key in _SCALAR_HINTS
            else value
            for key, value in values.items()
        }


_SCALAR_HINTS = {
    name: hint for name, hint in typing.get_type_hints(SamplingParams).items() if typing.get_origin(hint) is not list
}
