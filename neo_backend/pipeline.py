"""NEO's asymmetric two-sub-batch pipeline.

Sub-batch 0 holds the prefills, the GPU decodes and some CPU decodes; sub-batch 1 holds the other CPU
decodes. Layer by layer the device runs one sub-batch's dense work while a worker thread runs the other's
CPU attention (the kernel releases the GIL):

    device: | d0(L) | d1(L) | d0(L+1) | d1(L+1) | ...     d = post-attention(L-1) + pre-attention(L)
    host:           | a0(L) | a1(L)   | a0(L+1) | ...     a = decode attention over the host pool

The main thread only blocks on a CPU attention result right before launching the dense work that consumes
it, by which time the device has the other sub-batch's work queued.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .host_kv import HostAttention, HostDecodeBatch
from .layers.attention import AttentionMetadata


@dataclass
class SubBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    host_batch: HostDecodeBatch | None


class _Lane:
    """One sub-batch's progress through the layers."""

    def __init__(self, model, sub: SubBatch) -> None:
        self.sub = sub
        self.hidden = model.embed_tokens(sub.input_ids)
        self.residual: torch.Tensor | None = None
        self.attn_out: torch.Tensor | None = None
        self.host_future: Future | None = None

    def collect_host_rows(self, device: torch.device) -> None:
        if self.host_future is not None:
            n = self.sub.meta.num_device_tokens
            self.attn_out[n:] = self.host_future.result().to(device, non_blocking=True)
            self.host_future = None


class PipelinedExecutor:
    def __init__(self, host_attention: HostAttention) -> None:
        self.host_attention = host_attention
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neo-cpu-attention")

    def run(self, model, subs: list[SubBatch]) -> list[torch.Tensor]:
        """Final hidden states of each sub-batch."""
        device = model.embed_tokens.weight.device
        lanes = [_Lane(model, sub) for sub in subs]
        previous = None
        for layer in model.layers:
            for lane in lanes:
                if previous is not None:
                    lane.collect_host_rows(device)
                    lane.hidden, lane.residual = previous.attention_outputs(lane.attn_out, lane.residual)
                self._attend(layer, lane, device)
            previous = layer
        finals = []
        for lane in lanes:
            lane.collect_host_rows(device)
            lane.hidden, lane.residual = previous.attention_outputs(lane.attn_out, lane.residual)
            finals.append(model.norm(lane.hidden, lane.residual)[0])
        return finals

    def _attend(self, layer, lane: _Lane, device: torch.device) -> None:
        sub = lane.sub
        q, k, v, lane.residual = layer.attention_inputs(sub.positions, lane.hidden, lane.residual)
        lane.attn_out = layer.attn.device_attention(q, k, v, sub.meta)
        if sub.host_batch is None:
            return
        n = sub.meta.num_device_tokens
        host_q, host_k, host_v = self.host_attention.to_host(q[n:], k[n:], v[n:])
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        layer_idx, batch = layer.attn.layer_idx, sub.host_batch

        def attend_on_host() -> torch.Tensor:
            if ready is not None:
                ready.synchronize()
            return self.host_attention.run(layer_idx, batch, host_q, host_k, host_v)

        lane.host_future = self.worker.submit(attend_on_host)

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)
