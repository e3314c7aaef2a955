"""NEO's asymmetric two-sub-batch pipeline.

Sub-batch 0 holds the prefills, the GPU decodes and some CPU decodes; sub-batch 1 holds the other CPU
decodes. Layer by layer the device runs one sub-batch's dense work while a worker thread runs the other's
CPU attention (the kernel releases the GIL):

    device: | d0(L) | d1(L) | d0(L+1) | d1(L+1) | ...     d = post-attention(L-1) + pre-attention(L)
    host:           | a0(L) | a1(L)   | a0(L+1) | ...     a = decode attention over the host pool

The device waits for a CPU attention result right before the dense work that consumes it: on CUDA with a
device-side wait on the host's flag (stream_flags.py), so the launching thread queues the whole iteration at
once; elsewhere the launching thread waits, by which time the device has the other sub-batch's work queued.
With one sub-batch this is the sequential mode. A decode-only sub-batch replays captured segment graphs
(`GraphLane`); one that carries prefills, or runs without CUDA graphs, launches its kernels eagerly (`EagerLane`).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..cpu.handoff import Flags, IterationLane, spin_seconds
from ..errors import KernelError
from ..layers.attention import AttentionMetadata
from .cuda_graphs import LaneGraphs
from .host_attention import HostAttention, HostDecodeBatch
from .segments import HandOffBuffers, HostHandOff, LayerSegments
from .stream_flags import enqueue_wait


@dataclass
class SubBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    host_batch: HostDecodeBatch | None


class EagerLane(LayerSegments):
    """A sub-batch laid out as [prefills | device decodes | host decodes], run with eager launches. Its host
    rows go through the lane's `HandOffBuffers`, like a `GraphLane`'s."""

    def __init__(self, model, sub: SubBatch, hand_off: HandOffBuffers) -> None:
        self.sub = sub
        host = None if sub.host_batch is None else HostHandOff(hand_off, sub.meta.num_device_tokens)
        super().__init__(model, sub.input_ids, sub.positions, sub.meta, host)
        self.hidden: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.attn_out: torch.Tensor | None = None

    @property
    def ready(self) -> Flags:
        return self.host.buffers.ready

    def saved(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.host is None:
            return self.attn_out, self.residual
        host_out = self.host.buffers.out_on_device[: self.sub.host_batch.size]
        return torch.cat((self.attn_out[: self.host.first_row], host_out)), self.residual

    def save(self, attn: torch.Tensor, residual: torch.Tensor) -> None:
        self.attn_out, self.residual = attn, residual

    def finish(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    def host_lane(self) -> IterationLane:
        return self.host.buffers.iteration_lane(slice(0, self.sub.host_batch.size), self.sub.host_batch)

    def final(self) -> torch.Tensor:
        return self.hidden


class GraphLane:
    """A decode-only sub-batch, [device decodes | host decodes], replaying one `LaneGraphs`' segments."""

    def __init__(self, graphs: LaneGraphs, sub: SubBatch) -> None:
        self.graphs, self.sub = graphs, sub
        self.rows = sub.input_ids.numel()
        self.num_device = sub.meta.num_decodes
        self.with_host = sub.host_batch is not None
        self.bs = graphs.load(sub.input_ids, sub.positions, sub.meta, self.rows - self.num_device)
        self.ready = graphs.hand_off.ready

    def segment(self, layer_idx: int) -> None:
        self.graphs.replay(self.bs, self.with_host, layer_idx)

    def host_lane(self) -> IterationLane:
        return self.graphs.hand_off.iteration_lane(slice(self.num_device, self.rows), self.sub.host_batch)

    def final(self) -> torch.Tensor:
        return self.graphs.final[: self.rows]


class PipelinedExecutor:
    """Runs the lanes layer by layer on the launching thread while a worker thread runs their CPU attention.

    The worker spends the whole iteration in one library call (`HostAttention.run_iteration`), so no Python
    and no GIL sits between layers on the CPU side. Hand-offs go through `Flags` in host memory: a lane's
    stream sets its ready flag for a layer behind that layer's q/k/v (`HandOffBuffers`), the library sets a done
    flag per step (layer x lanes with host rows, in launch order), and on CUDA the device waits on it with a
    stream wait queued before the segment that consumes it; on a CPU device the launching thread waits on it by
    spinning in C with the GIL released. A layer's hand-off costs microseconds, not thread wake-ups.

    An iteration resets the flags once the device is through the last one's waits (`queued`), so no wait ever
    reads a flag of the next.
    """

    # Far beyond any iteration; a hand-off that takes longer means the other side is gone.
    HANDOFF_TIMEOUT_S = 120.0

    def __init__(
        self, host_attention: HostAttention, hand_offs: list[HandOffBuffers], lane_graphs: list[LaneGraphs] | None
    ) -> None:
        """`hand_offs`: each lane's host rows (lane i's graphs, if any, were captured against `hand_offs[i]`)."""
        self.host_attention = host_attention
        self.hand_offs = hand_offs
        self.lane_graphs = lane_graphs
        self.worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="neo-cpu-attention", initializer=host_attention.enter_thread
        )
        self.worker.submit(int).result()  # the worker starts now, not in the first iteration
        self.device_waits = host_attention.device.type == "cuda"  # the runner checked `stream_flags.available`
        self.done = Flags(0, spin_seconds(host_attention.device), pin=self.device_waits)
        self.queued: torch.cuda.Event | None = None  # recorded behind the last iteration's device waits

    def run(self, model, subs: list[SubBatch]) -> list[torch.Tensor]:
        """Final hidden states of each sub-batch (one: sequential mode; two: pipelined)."""
        lanes = [self._lane(model, i, sub) for i, sub in enumerate(subs)]
        host_lanes = [lane for lane in lanes if lane.sub.host_batch is not None]
        num_layers = len(model.layers)
        if self.queued is not None:
            self.queued.synchronize()
            self.queued = None
        self.done.reset(num_layers * len(host_lanes))
        for lane in host_lanes:
            lane.ready.reset(num_layers)
        job = None
        if host_lanes:
            job = self.worker.submit(self._attend_on_host, [lane.host_lane() for lane in host_lanes])
        slot = {id(lane): i for i, lane in enumerate(host_lanes)}  # position among the lanes with host rows
        issued = [0] * len(host_lanes)  # per host lane: layers whose ready flag the device was asked to set
        try:
            for layer_idx in range(num_layers + 1):
                for lane in lanes:
                    i = slot.get(id(lane))
                    if i is not None and layer_idx > 0:
                        self._await_done((layer_idx - 1) * len(host_lanes) + i, job)
                    lane.segment(layer_idx)
                    if i is not None and layer_idx < num_layers:
                        issued[i] += 1
            if job is not None:
                if self.device_waits:
                    self.queued = torch.cuda.Event()
                    self.queued.record()
                job.result()
        except BaseException:
            self._abandon(host_lanes, issued, job)
            raise
        return [lane.final() for lane in lanes]

    def _attend_on_host(self, host_lanes: list[IterationLane]) -> None:
        try:
            self.host_attention.run_iteration(host_lanes, self.done, self.HANDOFF_TIMEOUT_S)
        except BaseException:
            self.done.fail_pending()  # the launching thread stops waiting and re-raises this from the job
            raise

    def _await_done(self, step: int, job: Future) -> None:
        """The work launched next runs after done flag `step`: queued behind a device-side wait, or launched once
        the flag is set. A failed flag releases a device wait too; the worker's error then comes from `run`."""
        if self.device_waits:
            enqueue_wait(torch.cuda.current_stream(), self.done.address(step))
            return
        if not self.done.wait(step, self.HANDOFF_TIMEOUT_S):
            job.result()  # raises the worker's error
            raise KernelError("CPU attention stopped without an error")

    def _abandon(self, host_lanes: list[EagerLane | GraphLane], issued: list[int], job: Future | None) -> None:
        """The launching side failed mid-iteration: stop the worker at the first step it will never get, and
        let the device's queued work end before the flags and buffers are reused."""
        for lane, count in zip(host_lanes, issued):
            lane.ready.fail_from(count)
        if job is not None:
            wait([job])
        if self.host_attention.device.type == "cuda":
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize(self.host_attention.device)

    def _lane(self, model, index: int, sub: SubBatch) -> EagerLane | GraphLane:
        graphs = self.lane_graphs[index] if self.lane_graphs is not None else None
        if graphs is not None and not sub.meta.prefills and graphs.inputs.fits(sub.input_ids.numel()):
            return GraphLane(graphs, sub)
        return EagerLane(model, sub, self.hand_offs[index])

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)
