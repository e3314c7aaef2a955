"""NEO's asymmetric two-sub-batch pipeline.

Sub-batch 0 holds the prefills, the GPU decodes and some CPU decodes; sub-batch 1 holds the other CPU
decodes. Layer by layer the device runs one sub-batch's dense work while a worker thread runs the other's
CPU attention (the kernel releases the GIL):

    device: | d0(L) | d1(L) | d0(L+1) | d1(L+1) | ...     d = post-attention(L-1) + pre-attention(L)
    host:           | a0(L) | a1(L)   | a0(L+1) | ...     a = decode attention over the host pool

The main thread only blocks on a CPU attention result right before launching the dense work that consumes
it, by which time the device has the other sub-batch's work queued. With one sub-batch this is the
sequential mode. A decode-only sub-batch replays captured segment graphs (`GraphLane`); one that carries
prefills, or runs without CUDA graphs, launches its kernels eagerly (`EagerLane`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .cuda_graphs import LaneGraphs
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
    def __init__(self, host_attention: HostAttention, lane_graphs: list[LaneGraphs] | None = None) -> None:
        self.host_attention = host_attention
        self.lane_graphs = lane_graphs
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neo-cpu-attention")

    def run(self, model, subs: list[SubBatch]) -> list[torch.Tensor]:
        """Final hidden states of each sub-batch (one: sequential mode; two: pipelined)."""
        lanes = [self._lane(model, i, sub) for i, sub in enumerate(subs)]
        futures: list[Future | None] = [None] * len(lanes)
        num_layers = len(model.layers)
        for layer_idx in range(num_layers + 1):
            for i, lane in enumerate(lanes):
                if futures[i] is not None:
                    futures[i].result()
                    futures[i] = None
                lane.segment(layer_idx)
                if layer_idx < num_layers and lane.sub.host_batch is not None:
                    futures[i] = self._attend_on_host(lane, layer_idx)
        return [lane.final() for lane in lanes]

    def _lane(self, model, index: int, sub: SubBatch) -> EagerLane | GraphLane:
        graphs = self.lane_graphs[index] if self.lane_graphs is not None else None
        if graphs is not None and not sub.meta.prefills and graphs.inputs.fits(sub.input_ids.numel()):
            return GraphLane(graphs, sub)
        return EagerLane(model, sub, self.host_attention)

    def _attend_on_host(self, lane: EagerLane | GraphLane, layer_idx: int) -> Future:
        ready = None
        if self.host_attention.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        q, k, v, out = lane.host_inputs()
        batch = lane.sub.host_batch

        def attend() -> None:
            if ready is not None:
                ready.synchronize()
            self.host_attention.run(layer_idx, batch, q, k, v, out)

        return self.worker.submit(attend)

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)
