"""A step as rank 0 tells the other tensor-parallel ranks about it: the batch by request id, with each scheduled
sequence's new tokens and changed block table only. A worker mirrors the running requests from these orders, so a
prompt crosses the control channel once, not every step."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.sampling_params import SamplingParams
from ..core.scheduler_output import SchedulerOutput
from ..core.sequence import Sequence


@dataclass
class SequenceDelta:
    request_id: str
    new_token_ids: list[int]  # since the last order that carried this sequence (all of them the first time)
    num_computed_tokens: int
    block_table: list[int] | None  # None: unchanged since the last order


@dataclass
class StepOrder:
    finished: list[str]  # request ids the worker drops first
    deltas: list[SequenceDelta]
    prefills: list[tuple[str, int]]
    gpu_decodes: list[str]
    cpu_decodes: list[str]
    pipelined: bool
    split: int


@dataclass
class _Sent:
    seq: Sequence
    num_tokens: int
    block_table: list[int]


class StepSender:
    """Rank 0's side: what each worker's mirror holds, so an order carries only what changed."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def finished(self) -> list[str]:
        """Request ids the mirrors hold whose sequences have finished since; forgotten here."""
        done = [request_id for request_id, sent in self._sent.items() if sent.seq.finished]
        for request_id in done:
            del self._sent[request_id]
        return done

    def order(self, batch: SchedulerOutput) -> StepOrder:
        finished = self.finished()
        deltas = [self._delta(seq) for seq, _ in batch.scheduled()]
        return StepOrder(
            finished,
            deltas,
            [(seq.request_id, n) for seq, n in batch.prefills],
            [seq.request_id for seq in batch.gpu_decodes],
            [seq.request_id for seq in batch.cpu_decodes],
            batch.pipelined,
            batch.split,
        )

    def _delta(self, seq: Sequence) -> SequenceDelta:
        sent = self._sent.get(seq.request_id)
        if sent is None or sent.seq is not seq:
            sent = self._sent[seq.request_id] = _Sent(seq, 0, [])
            table = list(seq.block_table)
        else:
            table = None if sent.block_table == seq.block_table else list(seq.block_table)
        new_tokens = seq.token_ids[sent.num_tokens :]
        sent.num_tokens = len(seq.token_ids)
        if table is not None:
            sent.block_table = table
        return SequenceDelta(seq.request_id, new_tokens, seq.num_computed_tokens, table)


class SequenceMirror:
    """A worker's side: the running requests as far as its model runner needs them (tokens, progress, blocks)."""

    def __init__(self) -> None:
        self.seqs: dict[str, Sequence] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.seqs.pop(request_id, None)

    def batch(self, order: StepOrder) -> SchedulerOutput:
        self.forget(order.finished)
        for delta in order.deltas:
            seq = self.seqs.get(delta.request_id)
            if seq is None:
                seq = self.seqs[delta.request_id] = Sequence(delta.request_id, None, [], SamplingParams())
            seq.token_ids += delta.new_token_ids
            seq.num_computed_tokens = delta.num_computed_tokens
            if delta.block_table is not None:
                seq.block_table = delta.block_table
        seqs = self.seqs
        return SchedulerOutput(
            prefills=[(seqs[request_id], n) for request_id, n in order.prefills],
            gpu_decodes=[seqs[request_id] for request_id in order.gpu_decodes],
            cpu_decodes=[seqs[request_id] for request_id in order.cpu_decodes],
            pipelined=order.pipelined,
            split=order.split,
        )
