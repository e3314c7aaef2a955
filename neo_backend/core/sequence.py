"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

# Where a sampled token still on its way from the device stands in `Sequence.token_ids` (overlapped steps: the
# engine launches the next step before it reads the token back, and the device feeds it to that step).
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Placement(enum.Enum):
    """Where a running request's KV cache lives, and so where its decode attention runs (NEO)."""

    GPU = "gpu"
    CPU = "cpu"


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    placement: Placement = Placement.GPU
    finish_reason: str | None = None
    error: str | None = None
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finishing: bool = False  # its pending token is its last (a length limit): it needs no more steps

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """One token left to compute on top of a filled cache: a decode step, not a prefill chunk."""
        return self.num_computed_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cache; the next prefill covers prompt and output so far."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING
        self.placement = Placement.GPU
