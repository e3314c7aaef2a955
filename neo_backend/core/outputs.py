"""What the engine reports back for a request, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_output_tokens: int

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    text: str  # text produced since the previous output of this request
    token_ids: list[int]  # tokens produced since the previous output
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    num_prompt_tokens: int
    num_output_tokens: int
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None = None  # per new token: {token id: logprob}, the sampled one first
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
