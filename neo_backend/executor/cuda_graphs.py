"""CUDA graphs. Launching ~12 kernels per layer from Python costs more than an 8B model's decode step on an H200;
a replay costs one launch.

- `DecodeGraphs`: the whole model per batch-size bucket and block-table width, for GPU-only decode steps.
- `LaneGraphs`: one NEO pipeline lane's layer segments (segments.py) per bucket, so the two sub-batches
  can interleave layer by layer around the CPU attention without paying eager launches.
- `MixedGraphs`: the dense work between two attentions per bucket of rows, for GPU-only steps that prefill
  (beside decodes or not); their attention, whose launch shape follows the step's prompts, runs eagerly between.

All replay with the step's inputs copied into static buffers. Padded rows, and rows whose attention runs on the
host, write their k/v to a scratch block that no request owns (and, in decode graphs, attend to it alone).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ..layers.attention import AttentionMetadata
from .segments import HandOffBuffers, HostHandOff, LayerSegments

if TYPE_CHECKING:
    from .gemm_libraries import GemmLibraries

log = logging.getLogger("neo_backend")

PROGRESS_SECONDS = 10.0
# Steps of more rows than this run eagerly: from ~1000 prompt tokens the device's work outlasts the launches.
MIXED_MAX_ROWS = 512
MIXED_ROW_STEP = 32


class CaptureProgress:
    """Logs every PROGRESS_SECONDS how many of `total` graphs are captured: a first start compiles Triton kernels
    and times each GEMM shape as it captures, which can take minutes."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.start = self.last_log = time.monotonic()

    def captured(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last_log >= PROGRESS_SECONDS and self.done < self.total:
            log.info("captured %d of %d %s (%.0fs)", self.done, self.total, self.what, now - self.start)
            self.last_log = now


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


def width_buckets(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths of the decode graphs: powers of two from 512 tokens, then the widest table. The decode
    attention's grid follows the table's width (`paged_decode`), and a graph fixes its grid: one graph as wide as
    the longest context would launch 8x the programs a 1024-token batch needs at 8192 positions, and the extra
    ones, though they exit at once, cost the decode graph 2.3 ms at batch 256 (bench/RESULTS.md)."""
    widths, width = [], max(1, 512 // block_size)
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return widths + [max_blocks]


def lane_buckets(max_batch: int) -> list[int]:
    """Coarser than `batch_buckets`, as a lane has (layers + 1) graphs per bucket: 2, 4, then powers of two from
    8 and the sizes halfway up (24, 48, 96...), so from 8 rows no more than a third of a bucket is padding.
    Padded rows cost little while the segment's time is the weights' read, but not nothing: at 8 SMs each adds
    ~0.12 ms to a 7B model's iteration, and a lane of a few device decodes and a CPU decode or two is the
    common case where device memory is short. On a GPU of few SMs a batch of ~100 rows is compute-bound."""
    sizes = [2, 4] + [size for i in range(max(1, max_batch).bit_length()) for size in (8 << i, 12 << i)]
    return sorted({min(s, max_batch) for s in sizes})


class DecodeInputs:
    """Static input buffers of captured decode graphs, for up to `max_batch` rows."""

    def __init__(
        self, device: torch.device, max_batch: int, max_blocks_per_seq: int, scratch_block: int, block_size: int
    ) -> None:
        self.max_batch = max_batch
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=device)

    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.max_batch

    def meta(self, bs: int, width: int | None = None) -> AttentionMetadata:
        """Every row of the bucket attends on the device (rows past the real decodes, to the scratch block), over
        tables `width` blocks wide (default: the widest)."""
        return AttentionMetadata(
            slot_mapping=self.slots[:bs],
            prefills=[],
            num_prefill_tokens=0,
            decode_block_tables=self.tables[:bs, :width],
            decode_context_lens=self.lens[:bs],
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bs: int) -> None:
        """Copy a decode-only (sub-)batch in: its device decodes first, then rows (host decodes, padding) that
        point at the scratch block."""
        n, d = input_ids.numel(), meta.num_decodes
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:d].copy_(meta.slot_mapping)
        self.slots[d:bs].fill_(self.scratch_slot)
        self.tables[:d, :width].copy_(meta.decode_block_tables)
        self.tables[d:bs].fill_(self.scratch_block)
        self.lens[:d].copy_(meta.decode_context_lens)
        self.lens[d:bs].fill_(1)


def bucket_for(buckets: list[int], rows: int) -> int:
    return next(b for b in buckets if b >= rows)


class DecodeGraphs:
    def __init__(self, model, inputs: DecodeInputs, widths: list[int], gemms: GemmLibraries) -> None:
        self.model = model
        self.inputs = inputs
        self.gemms = gemms
        self.buckets = batch_buckets(inputs.max_batch)
        self.widths = widths  # block-table widths (`width_buckets`)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (batch bucket, table width)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.monotonic()
        progress = CaptureProgress("decode CUDA graphs", len(self.buckets) * len(self.widths))
        pool = None
        for bs in reversed(self.buckets):
            for width in reversed(self.widths):

                def forward(bs: int = bs, width: int = width) -> torch.Tensor:
                    inputs = self.inputs
                    return self.model(inputs.input_ids[:bs], inputs.positions[:bs], inputs.meta(bs, width))

                with self.gemms.applied(bs):
                    self.graphs[bs, width], self.outputs[bs, width] = capture(forward, pool)
                pool = self.graphs[bs, width].pool()
                progress.captured()
        log.info(
            "captured %d decode CUDA graphs (%d batch sizes up to %d, %d table widths up to %d blocks) in %.1fs; %s",
            len(self.graphs),
            len(self.buckets),
            self.inputs.max_batch,
            len(self.widths),
            self.widths[-1],
            time.monotonic() - start,
            self.gemms.summary(),
        )

    def can_run(self, num_decodes: int) -> bool:
        return self.inputs.fits(num_decodes)

    def key(self, rows: int, width: int) -> tuple[int, int]:
        """The graph that runs `rows` decodes whose block tables are `width` blocks wide."""
        return bucket_for(self.buckets, rows), bucket_for(self.widths, width)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only batch (rows in order), through the smallest fitting graph."""
        n = input_ids.numel()
        key = self.key(n, meta.decode_block_tables.shape[1])
        self.inputs.load(input_ids, positions, meta, key[0])
        self.graphs[key].replay()
        return self.outputs[key][:n]


def mixed_buckets(max_rows: int) -> list[int]:
    """Row counts of the mixed-step graphs: 16, then every multiple of 32 up to `max_rows` (and `max_rows`). Past a
    few hundred rows a step's GEMMs are compute-bound, so a padded row costs as much as a real one: the step of 32
    keeps that waste under 32 rows."""
    sizes = [size for size in (16, *range(MIXED_ROW_STEP, max_rows, MIXED_ROW_STEP)) if size < max_rows]
    return sizes + [max_rows]


class MixedGraphs:
    """GPU-only steps that prefill, of up to `max_rows` rows ([prefill chunks | decodes], padded to a bucket), as
    captured pieces: piece L is layer L-1's output half and layer L's input half (its q/k/v stored in the pool),
    piece `num_layers` the last output half and the final norm. Each layer's attention runs eagerly between two
    pieces, on the real rows, as it does in an eager step. Eagerly such a step launches ~11 kernels a layer, which
    takes the host longer than the device's work up to a few hundred prompt tokens (bench/RESULTS.md, "Steps
    that mix a prompt with decodes"); with the pieces a layer costs a replay and the attention's launches."""

    def __init__(self, model, device: torch.device, max_rows: int, scratch_slot: int, gemms: GemmLibraries) -> None:
        cfg, dtype = model.rank_config, model.embed_tokens.weight.dtype
        self.model, self.gemms, self.scratch_slot = model, gemms, scratch_slot
        self.buckets = mixed_buckets(max_rows)
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slots = torch.full((max_rows,), scratch_slot, dtype=torch.long, device=device)
        qkv_size = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv = torch.zeros(max_rows, qkv_size, dtype=dtype, device=device)
        self.attn = torch.zeros(max_rows, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(max_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.final = torch.zeros(max_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (bucket, piece)
        self._capture()

    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.buckets[-1]

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.monotonic()
        num_pieces = len(self.model.layers) + 1
        progress = CaptureProgress("mixed-step CUDA graphs", len(self.buckets) * num_pieces)
        pool = None
        for rows in reversed(self.buckets):
            with self.gemms.applied(rows):
                for piece in range(num_pieces):
                    graph, _ = capture(lambda: self._piece(piece, rows), pool)
                    self.graphs[rows, piece], pool = graph, graph.pool()
                    progress.captured()
        log.info(
            "captured %d mixed-step CUDA graphs (%d row counts up to %d) in %.1fs",
            len(self.graphs),
            len(self.buckets),
            self.buckets[-1],
            time.monotonic() - start,
        )

    def _piece(self, piece: int, rows: int) -> None:
        model = self.model
        if piece == 0:
            hidden, residual = model.embed_tokens(self.input_ids[:rows]), None
        else:
            hidden, residual = model.layers[piece - 1].attention_outputs(self.attn[:rows], self.residual[:rows])
        if piece == len(model.layers):
            self.final[:rows].copy_(model.norm(hidden, residual)[0])
            return
        store = AttentionMetadata(
            slot_mapping=self.slots[:rows],
            prefills=[],
            num_prefill_tokens=0,
            decode_block_tables=self.slots.new_zeros(0, 1, dtype=torch.int32),
            decode_context_lens=self.slots.new_zeros(0, dtype=torch.int32),
        )
        qkv, residual = model.layers[piece].attention_inputs(self.positions[:rows], hidden, residual, store)
        self.qkv[:rows].copy_(qkv)
        self.residual[:rows].copy_(residual)

    def _replay(self, rows: int, piece: int) -> None:
        self.graphs[rows, piece].replay()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a GPU-only step's rows, in order: its pieces replayed at the smallest fitting bucket,
        each layer's attention launched between them."""
        n = input_ids.numel()
        rows = bucket_for(self.buckets, n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:rows].fill_(self.scratch_slot)
        for piece, layer in enumerate(self.model.layers):
            self._replay(rows, piece)
            layer.attn(*layer.split_qkv(self.qkv[:n]), meta, out=self.attn[:n])
        self._replay(rows, len(self.model.layers))
        return self.final[:n]


def capture(fn, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up outside the graph (Triton compiles, the allocator settles), then capture it: on the current
    stream unless that is the default stream, which cannot capture. A graph replays on the SMs of the stream it
    was captured on, so an SM partition's graphs must be captured on the partition's stream."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream = None if current == torch.cuda.default_stream() else current
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


class LaneGraphs:
    """One pipeline lane's decode-only layer segments (segments.py), captured per bucket and per `with_host`
    (whether the lane carries host rows: their q/k/v go to the lane's `hand_off` buffers in host memory and their
    attention comes back from there). Tensors that live across segments are static: `attn`, `residual`, `final`
    on the device and the hand-off buffers, whose rows match the bucket's.
    """

    def __init__(
        self,
        model,
        inputs: DecodeInputs,
        host_variants: tuple[bool, ...],
        gemms: GemmLibraries,
        hand_off: HandOffBuffers,
    ) -> None:
        cfg, device, dtype = model.rank_config, inputs.input_ids.device, model.embed_tokens.weight.dtype
        n = inputs.max_batch
        self.model, self.inputs, self.hand_off = model, inputs, hand_off
        self.buckets = lane_buckets(n)
        self.attn = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.final = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.host_mask = torch.zeros(n, 1, 1, dtype=torch.bool, device=device)
        self.graphs: dict[tuple[int, bool, int], torch.cuda.CUDAGraph] = {}
        num_segments = len(model.layers) + 1
        progress = CaptureProgress("pipeline segment graphs", len(self.buckets) * len(host_variants) * num_segments)
        pool = None
        for bs in reversed(self.buckets):
            with gemms.applied(bs):
                for with_host in host_variants:
                    for layer in range(num_segments):
                        graph, _ = capture(lambda: self._segment(layer, bs, with_host), pool)
                        self.graphs[bs, with_host, layer], pool = graph, graph.pool()
                        progress.captured()

    @torch.inference_mode()
    def _segment(self, layer_idx: int, bs: int, with_host: bool) -> None:
        _BucketSegments(self, bs, with_host).segment(layer_idx)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_host: int) -> int:
        """Copy a decode-only lane in (device decodes, then `num_host` host decodes); returns its bucket."""
        bs = bucket_for(self.buckets, input_ids.numel())
        self.inputs.load(input_ids, positions, meta, bs)
        if num_host:
            self.host_mask[:bs].fill_(False)
            self.host_mask[meta.num_decodes : meta.num_decodes + num_host].fill_(True)
        return bs

    def replay(self, bs: int, with_host: bool, segment: int) -> None:
        self.graphs[bs, with_host, segment].replay()


class _BucketSegments(LayerSegments):
    """A `LaneGraphs` bucket's segments as captured: every tensor that outlives a segment is a static buffer, and
    host rows are merged by `host_mask`, as their number changes from one replay to the next."""

    def __init__(self, graphs: LaneGraphs, bs: int, with_host: bool) -> None:
        g, inputs = graphs, graphs.inputs
        host = HostHandOff(g.hand_off, first_row=0) if with_host else None
        super().__init__(g.model, inputs.input_ids[:bs], inputs.positions[:bs], inputs.meta(bs), host)
        self.graphs, self.bs = graphs, bs

    def saved(self) -> tuple[torch.Tensor, torch.Tensor]:
        g, bs = self.graphs, self.bs
        attn = g.attn[:bs]
        if self.host is not None:
            attn = torch.where(g.host_mask[:bs], self.host.buffers.out_on_device[:bs], attn)
        return attn, g.residual[:bs]

    def save(self, attn: torch.Tensor, residual: torch.Tensor) -> None:
        self.graphs.attn[: self.bs].copy_(attn)
        self.graphs.residual[: self.bs].copy_(residual)

    def finish(self, hidden: torch.Tensor) -> None:
        self.graphs.final[: self.bs].copy_(hidden)
