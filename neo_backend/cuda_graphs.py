"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket, replayed with the step's
inputs copied into static buffers. Launching ~25 kernels per layer from Python costs more than an 8B
model's decode step on an H200; a replay costs one launch. Padded rows write their k/v to a scratch block
that no request owns and attend to it alone."""
from __future__ import annotations

import logging
import time

import torch

from .layers.attention import AttentionMetadata

log = logging.getLogger("neo_backend")


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_batch: int, max_blocks_per_seq: int, scratch_block: int,
                 block_size: int) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.hidden = torch.empty(0)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture(device)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:bs], prefills=[], num_prefill_tokens=0,
                                 decode_block_tables=self.tables[:bs], decode_context_lens=self.lens[:bs])

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        start = time.monotonic()
        pool = None
        for bs in reversed(self.buckets):
            for _ in range(2):  # warm up: Triton autotuning and allocator state outside the capture
                self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        log.info("captured decode CUDA graphs for %d batch sizes up to %d in %.1fs", len(self.buckets),
                 self.max_batch, time.monotonic() - start)

    def can_run(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only batch (rows in order), through the smallest fitting graph."""
        n = input_ids.numel()
        bs = next(b for b in self.buckets if b >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:bs].fill_(self.scratch_slot)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.tables[n:bs].fill_(self.scratch_block)
        self.lens[:n].copy_(meta.decode_context_lens)
        self.lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
