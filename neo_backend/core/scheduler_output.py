"""The scheduler's plan for one iteration: what runs where, and the swaps the model runner carries out first."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class SwapIn:
    """Copy a CPU-request's host blocks up to the device blocks it now owns."""

    host_blocks: list[int]
    device_blocks: list[int]


@dataclass
class SwapOut:
    """Copy a request's device blocks down to the host blocks it now owns."""

    request_id: str
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass
class SchedulerOutput:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens in this chunk)
    gpu_decodes: list[Sequence] = field(default_factory=list)
    cpu_decodes: list[Sequence] = field(default_factory=list)
    pipelined: bool = False
    split: int = 0  # pipelined: cpu_decodes[:split] ride in sub-batch 0, the rest in 1
    # The runner's order: swap-ins; then, where a preempted request's host blocks were still being copied into,
    # every swap-out in flight lands; then the swap-outs whose device blocks this step reuses, each landed at once.
    swap_in: list[SwapIn] = field(default_factory=list)
    land_swap_outs: bool = False
    swap_out: list[SwapOut] = field(default_factory=list)
    offload_after_step: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    predicted_time: float = 0.0
    predicted_cpu_time: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.gpu_decodes or self.cpu_decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def mode(self) -> str:
        if not self.cpu_decodes:
            return "gpu_only"
        return "pipelined" if self.pipelined else "sequential"

    def gpu_work(self) -> tuple[int, int]:
        """(tokens, context tokens) of the iteration's device part."""
        tokens = self.num_prefill_tokens + len(self.gpu_decodes)
        ctx = sum(len(s.token_ids) for s in self.gpu_decodes) + sum(s.num_computed_tokens + n for s, n in self.prefills)
        return tokens, ctx

    def drop_finished(self) -> None:
        """Leave out requests that finished after this plan was made (their last token was read back after it):
        their blocks are free."""
        self.prefills = [(s, n) for s, n in self.prefills if not s.finished]
        self.gpu_decodes = [s for s in self.gpu_decodes if not s.finished]
        self.split = sum(not s.finished for s in self.cpu_decodes[: self.split])
        self.cpu_decodes = [s for s in self.cpu_decodes if not s.finished]

    def scheduled(self) -> list[tuple[Sequence, int]]:
        return self.prefills + [(s, 1) for s in self.gpu_decodes + self.cpu_decodes]
