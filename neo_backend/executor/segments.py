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

from ..layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from ..cpu.handoff import Flags


@dataclass
class HostHandOff:
    """Host buffers of a lane's host rows: each layer copies rows `first_row:` of its packed q/k/v (`split_qkv`)
    into `qkv` in one piece and then sets the layer's `ready` flag; the CPU attention reads q/k/v as views of
    `qkv` and writes `out`. One copy: copying q, k and v apart took three gathers into contiguous tensors and three
    copies, and the device's own attention started 56 us after the rotary kernel instead of 22 at 8 SMs
    (bench/RESULTS.md)."""

    qkv: torch.Tensor
    out: torch.Tensor
    first_row: int
    ready: Flags
    one: torch.Tensor  # the value `ready.set_in_order` copies in, on the lane's device

    def send(self, layer_idx: int, qkv: torch.Tensor) -> None:
        self.qkv.copy_(qkv[self.first_row :], non_blocking=True)
        self.ready.set_in_order(layer_idx, self.one)


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
