"""Continuous batching: which requests run this iteration, and how many of their tokens.

Every iteration the running requests go first (decodes take one token, unfinished prefills continue in
chunks), then waiting requests are admitted while the token budget, `max_num_seqs` and free KV blocks allow;
the last admitted prompt may be chunked. When the pool cannot hold the next tokens, the newest running
request is preempted by recompute: its blocks are freed and it returns to the front of the waiting queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens in this chunk)
    gpu_decodes: list[Sequence] = field(default_factory=list)
    cpu_decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.gpu_decodes or self.cpu_decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    def scheduled(self) -> list[tuple[Sequence, int]]:
        return self.prefills + [(s, 1) for s in self.gpu_decodes + self.cpu_decodes]


class Scheduler:
    def __init__(self, config: EngineConfig, gpu_blocks: BlockManager) -> None:
        self.config = config
        self.gpu_blocks = gpu_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.gpu_blocks.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            n = 1 if seq.is_decode else min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, out):
                break
            (out.gpu_decodes.append(seq) if seq.is_decode else out.prefills.append((seq, n)))
            budget -= n
            idx += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow `seq` to `num_tokens` slots, preempting the newest running requests as needed."""
        while not self.gpu_blocks.can_grow(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.gpu_blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.gpu_blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.gpu_blocks.can_grow(seq, n):
                break
            self.waiting.popleft()
            self.gpu_blocks.grow(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append((seq, n))
            budget -= n
