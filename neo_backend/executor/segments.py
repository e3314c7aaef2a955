"""Layer segments: the device work between two attentions, the unit the NEO pipeline interleaves (pipeline.py).

Segment L runs, for L > 0, the merge of the host rows' attention of layer L-1 and that layer's output half; for
L < num_layers, the input half of layer L, the hand-off of the host rows' q/k/v and the device rows' attention. Segment
num_layers ends with the final norm. An eager lane and a lane's captured graphs (cuda_graphs.py) run this one
sequence of kernels; they differ only in where the tensors that outlive a segment are kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cpu.handoff import Flags, IterationLane, spin_seconds
from ..layers.attention import AttentionMetadata, split_qkv
from ..staging import device_view, write_rows
from . import stream_flags

if TYPE_CHECKING:
    from .host_attention import HostDecodeBatch


class HandOffBuffers:
    """A lane's host rows in host memory, allocated once for up to `max_rows` rows: their q/k/v packed as
    `split_qkv` reads them, the CPU attention's output, and one ready flag a layer. On CUDA they are pinned and
    the device's kernels reach them in place (`device_view`): a segment writes q/k/v into host memory and reads
    the output from it, and its stream sets the flag behind them. Copies there put the copy engine between the
    device's kernels three times a layer (~0.5 ms of a sequential iteration at 8 SMs, bench/RESULTS.md)."""

    def __init__(self, model, max_rows: int, device: torch.device) -> None:
        cfg, dtype = model.rank_config, model.embed_tokens.weight.dtype
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.on_cuda = device.type == "cuda"
        qkv_size = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv = torch.zeros(max_rows, qkv_size, dtype=dtype, pin_memory=self.on_cuda)
        self.out = torch.zeros(max_rows, cfg.num_heads, cfg.head_dim, dtype=dtype, pin_memory=self.on_cuda)
        self.qkv_on_device = device_view(self.qkv, device)
        self.out_on_device = device_view(self.out, device)
        self.ready = Flags(len(model.layers), spin_seconds(device), pin=self.on_cuda)

    def send(self, layer_idx: int, qkv: torch.Tensor) -> None:
        """Writes `qkv` (a lane's host rows, packed) to host memory, then sets the layer's ready flag."""
        write_rows(self.qkv_on_device[: qkv.shape[0]], qkv)
        if self.on_cuda:
            stream_flags.enqueue_set(torch.cuda.current_stream(), self.ready.address(layer_idx))
        else:
            self.ready.set(layer_idx)

    def iteration_lane(self, rows: slice, batch: HostDecodeBatch) -> IterationLane:
        """The CPU attention's side of host rows `rows`: it reads their q/k/v from these buffers and writes their
        outputs back to them."""
        q, k, v = split_qkv(self.qkv[rows], *self.heads)
        return IterationLane(q, k, v, self.out[rows], batch.block_tables, batch.context_lens, batch.slots, self.ready)


@dataclass
class HostHandOff:
    """Where a lane's rows meet its `HandOffBuffers`: each layer sends rows `first_row:` of its packed q/k/v to the
    buffers' first rows, and the CPU attention writes the host rows' outputs to the same rows (a graph lane sends
    a whole bucket, its device rows too, and merges back only the host rows)."""

    buffers: HandOffBuffers
    first_row: int

    def send(self, layer_idx: int, qkv: torch.Tensor) -> None:
        self.buffers.send(layer_idx, qkv[self.first_row :])


class LayerSegments(ABC):
    """One lane's segments over fixed inputs; subclasses keep the attention output and residual between them."""

    def __init__(
        self, model, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, host: HostHandOff | None
    ) -> None:
        self.model = model
        self.input_ids, self.positions, self.meta = input_ids, positions, meta
        self.host = host

    def segment(self, layer_idx: int) -> None:
        model = self.model
        if layer_idx == 0:
            hidden, residual = model.embed_tokens(self.input_ids), None
        else:
            hidden, residual = model.layers[layer_idx - 1].attention_outputs(*self.saved())
        if layer_idx == len(model.layers):
            self.finish(model.norm(hidden, residual)[0])
            return
        layer = model.layers[layer_idx]
        qkv, residual = layer.attention_inputs(self.positions, hidden, residual, self.meta)
        if self.host is not None:  # first: the host's attention of this layer then runs beside the device's
            self.host.send(layer_idx, qkv)
        self.save(layer.attn(*layer.split_qkv(qkv), self.meta), residual)

    @abstractmethod
    def saved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's attention output, with the host rows' merged in, and its residual."""

    @abstractmethod
    def save(self, attn: torch.Tensor, residual: torch.Tensor) -> None:
        """Keep this layer's attention output (device rows) and residual for the next segment."""

    @abstractmethod
    def finish(self, hidden: torch.Tensor) -> None:
        """Keep the final hidden states."""
