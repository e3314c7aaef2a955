"""NEO's asymmetric two-sub-batch pipeline.

Sub-batch 0 holds the prefills, the GPU decodes and some CPU decodes; sub-batch 1 holds the other CPU
decodes. Layer by layer the device runs one sub-batch's dense work while a worker thread runs the other's
CPU attention (the kernel releases the GIL):

    device: | d0(L) | d1(L) | d0(L+1) | d1(L+1) | ...     d = post-attention(L-1) + pre-attention(L)
    host:           | a0(L) | a1(L)   | a0(L+1) | ...     a = decode attention over the host pool

The main thread only waits for a CPU attention result right before launching the dense work that consumes
it, by which time the device has the other sub-batch's work queued. With one sub-batch this is the
sequential mode. A decode-only sub-batch replays captured segment graphs (`GraphLane`); one that carries
prefills, or runs without CUDA graphs, launches its kernels eagerly (`EagerLane`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from . import cpu_attention
from .cuda_graphs import LaneGraphs
from .errors import KernelError
from .host_kv import HostAttention, HostDecodeBatch
from .layers.attention import AttentionMetadata


@dataclass
class SubBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    host_batch: HostDecodeBatch | None


class EagerLane:
    """A sub-batch laid out as [prefills | device decodes | host decodes], run with eager launches."""

    def __init__(self, model, sub: SubBatch, host_attention: HostAttention) -> None:
        self.model, self.sub, self.host_attention = model, sub, host_attention
        self.num_device = sub.meta.num_device_tokens
        self.hidden = model.embed_tokens(sub.input_ids)
        self.residual: torch.Tensor | None = None
        self.attn_out: torch.Tensor | None = None
        self.host_qkv: list[torch.Tensor] = []
        self.host_out: torch.Tensor | None = None

    def segment(self, layer_idx: int) -> None:
        model, n = self.model, self.num_device
        if layer_idx > 0:
            if self.host_out is not None:
                self.attn_out[n:] = self.host_out.to(self.attn_out.device, non_blocking=True)
            self.hidden, self.residual = model.layers[layer_idx - 1].attention_outputs(self.attn_out, self.residual)
        if layer_idx == len(model.layers):
            self.hidden = model.norm(self.hidden, self.residual)[0]
            return
        layer = model.layers[layer_idx]
        q, k, v, self.residual = layer.attention_inputs(self.sub.positions, self.hidden, self.residual)
        self.attn_out = layer.attn(q, k, v, self.sub.meta)
        if self.sub.host_batch is not None:
            self.host_qkv = self.host_attention.to_host(q[n:], k[n:], v[n:])
            self.host_out = self.host_attention.output_buffer(self.host_qkv[0])

    def host_inputs(self) -> tuple[torch.Tensor, ...]:
        return (*self.host_qkv, self.host_out)

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

    def segment(self, layer_idx: int) -> None:
        self.graphs.replay(self.bs, self.with_host, layer_idx)

    def host_inputs(self) -> tuple[torch.Tensor, ...]:
        rows = slice(self.num_device, self.rows)
        g = self.graphs
        return g.host_q[rows], g.host_k[rows], g.host_v[rows], g.host_out[rows]

    def final(self) -> torch.Tensor:
        return self.graphs.final[:self.rows]


class PipelinedExecutor:
    """Runs the lanes layer by layer on the launching thread while one worker thread runs their CPU attention.

    Hand-offs go through two rows of `Flags`, one entry per CPU attention step of the iteration (step = layer x
    lanes with host rows, in launch order): `ready` (its inputs are queued on the device, its event recorded)
    and `done` (its output is in the lane's host buffer). Both threads wait by spinning in C with the GIL
    released, so a layer's hand-off costs microseconds rather than two thread wake-ups.
    """

    # Far beyond any iteration; a hand-off that takes longer means the other thread is gone.
    HANDOFF_TIMEOUT_S = 120.0
    # On CUDA both threads have a core of their own (the attention team leaves one to the launching thread):
    # they spin through any wait of an iteration. On a CPU device they share cores with the "device" work.
    CUDA_SPIN_S = 0.1

    def __init__(self, host_attention: HostAttention, lane_graphs: list[LaneGraphs] | None = None) -> None:
        self.host_attention = host_attention
        self.lane_graphs = lane_graphs
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neo-cpu-attention")
        spin_s = self.CUDA_SPIN_S if host_attention.device.type == "cuda" else 0.0
        self.ready = cpu_attention.Flags(0, spin_s)
        self.done = cpu_attention.Flags(0, spin_s)

    def run(self, model, subs: list[SubBatch]) -> list[torch.Tensor]:
        """Final hidden states of each sub-batch (one: sequential mode; two: pipelined)."""
        lanes = [self._lane(model, i, sub) for i, sub in enumerate(subs)]
        host_lanes = [i for i, lane in enumerate(lanes) if lane.sub.host_batch is not None]
        num_layers = len(model.layers)
        steps = [(layer, lanes[i]) for layer in range(num_layers) for i in host_lanes]
        self.ready.reset(len(steps))
        self.done.reset(len(steps))
        events: list[torch.cuda.Event | None] = [None] * len(steps)
        job = self.worker.submit(self._attend_on_host, steps, events) if steps else None
        step = 0
        try:
            for layer_idx in range(num_layers + 1):
                for i, lane in enumerate(lanes):
                    if i not in host_lanes:
                        lane.segment(layer_idx)
                        continue
                    if layer_idx > 0:
                        self._wait_done((layer_idx - 1) * len(host_lanes) + host_lanes.index(i), job)
                    lane.segment(layer_idx)
                    if layer_idx < num_layers:
                        events[step] = self._record()
                        self.ready.set(step)
                        step += 1
        except BaseException:
            self.ready.fail_from(step)  # the worker stops at the first step it was not given
            if job is not None:
                wait([job])
            raise
        if job is not None:
            job.result()
        return [lane.final() for lane in lanes]

    def _wait_done(self, step: int, job: Future) -> None:
        if not self.done.wait(step, self.HANDOFF_TIMEOUT_S):
            job.result()  # raises the worker's error
            raise KernelError("CPU attention stopped without an error")

    def _record(self) -> torch.cuda.Event | None:
        if self.host_attention.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _lane(self, model, index: int, sub: SubBatch) -> EagerLane | GraphLane:
        graphs = self.lane_graphs[index] if self.lane_graphs is not None else None
        if graphs is not None and not sub.meta.prefills and graphs.inputs.fits(sub.input_ids.numel()):
            return GraphLane(graphs, sub)
        return EagerLane(model, sub, self.host_attention)

    def _attend_on_host(self, steps: list[tuple[int, EagerLane | GraphLane]],
                        events: list[torch.cuda.Event | None]) -> None:
        """The worker's side of one iteration: each step once its inputs are ready, in launch order."""
        step = 0
        try:
            for step, (layer_idx, lane) in enumerate(steps):
                if not self.ready.wait(step, self.HANDOFF_TIMEOUT_S):
                    return
                if events[step] is not None:
                    events[step].synchronize()
                q, k, v, out = lane.host_inputs()
                self.host_attention.run(layer_idx, lane.sub.host_batch, q, k, v, out)
                self.done.set(step)
        except BaseException:
            self.done.fail_from(step)
            raise

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)
