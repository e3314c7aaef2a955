"""Tensor parallelism, Megatron-style, over a `torch.distributed` process group (NCCL on GPUs, gloo on CPU).

Each of `size` ranks holds 1/size of every sharded weight: q/k/v and gate/up split by output rows (column
parallel: each rank computes its heads and its slice of the FFN without talking to the others), o and down split
by input columns (row parallel: each rank's partial sum is completed by one all-reduce), the embedding and the
LM head split by vocabulary rows (each rank looks up or scores its own tokens; the embedding is all-reduced, the
logits all-gathered). Norms and rotary tables are replicated. Two all-reduces per layer, as in Megatron-LM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; size 1 (the default) needs no torch.distributed."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group

    def part(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, FFN rows, vocabulary rows), which `size` must divide."""
        if total % self.size:
            raise ConfigError(f"tensor_parallel_size={self.size} does not divide {what} ({total})")
        return total // self.size

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's attention and KV head counts: what its KV pools and attention buffers hold."""
        return dataclasses.replace(
            cfg,
            num_heads=self.part(cfg.num_heads, "the number of attention heads"),
            num_kv_heads=self.part(cfg.num_kv_heads, "the number of KV heads"),
        )

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a whole (checkpoint) tensor along `dim`."""
        if self.size == 1:
            return tensor
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x`, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (`device`: where the group's backend takes tensors)."""
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows (token ids) are split across ranks: ids outside this rank's rows look up zero, and
    the all-reduce fills them in from the rank that holds them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        rows = tp.part(vocab_size, "the vocabulary size")
        self.first_id = tp.rank * rows
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.first_id
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)
