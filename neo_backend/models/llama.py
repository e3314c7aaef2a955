"""Llama-family decoder. Parameter names follow Hugging Face's, with q/k/v and gate/up fused at load time.

Under tensor parallelism (`layers/parallel.py`) each rank builds the same modules at its share of the heads, the
FFN and the vocabulary, and `load_weights` copies in its slice of each checkpoint tensor."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..layers.activation import silu_and_mul
from ..layers.attention import AttentionMetadata, PagedAttention, split_qkv
from ..layers.blas import Linear
from ..layers.norm import RMSNorm
from ..layers.parallel import TensorParallel, VocabParallelEmbedding
from ..layers.rotary import RotaryEmbedding

# HF name suffix -> (fused parameter suffix, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns; every other weight of a layer by output rows


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer, split around attention so an executor can interleave sub-batches."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        rank_cfg = tp.rank_config(cfg)
        self.num_heads, self.num_kv_heads = rank_cfg.num_heads, rank_cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        intermediate = tp.part(cfg.intermediate_size, "the FFN size")
        self.rotary = rotary
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, cfg.head_dim)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, cfg.hidden_size, bias=False)

    def attention_inputs(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's packed q/k/v (`split_qkv`), q and k rotated and the device rows' k/v already in the pool,
        and the residual."""
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(x)
        self.attn.store_rotated(self.rotary, positions, *self.split_qkv(qkv), meta.slot_mapping)
        return qkv, residual

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)

    def attention_outputs(self, attn_out: torch.Tensor, residual: torch.Tensor):
        attn_out = self.tp.all_reduce(self.o_proj(attn_out.flatten(1)))
        hidden, residual = self.post_attention_layernorm(attn_out, residual)
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))), residual

    def forward(self, positions, hidden, residual, meta: AttentionMetadata):
        qkv, residual = self.attention_inputs(positions, hidden, residual, meta)
        return self.attention_outputs(self.attn(*self.split_qkv(qkv), meta), residual)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        self.rank_config = tp.rank_config(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab_rows = self.embed_tokens.weight.shape[0]
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the model's dtype (the sampler reads them in fp32)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.tp.all_gather_last(nn.functional.linear(hidden, weight))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be written exactly once."""
        params = dict(self.named_parameters())
        expected = {name: 1 for name in params}
        for name in params:
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected[name] = 3
            elif name.endswith("gate_up_proj.weight"):
                expected[name] = 2
        written = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            name, shard = self._param_name(hf_name)
            if name is None:
                continue
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
            self._copy(params[name], self._rank_slice(name, tensor), self._shard_span(name, shard))
            written[name] += 1
        missing = [n for n, count in written.items() if count != expected[n]]
        if missing:
            raise ModelLoadError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}")

    def _param_name(self, hf_name: str) -> tuple[str | None, int | None]:
        if "rotary_emb" in hf_name:
            return None, None
        name = hf_name.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "")
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return name, None

    def _rank_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor: norms whole, o/down by columns, the rest by rows."""
        if "norm" in name:
            return tensor
        return self.tp.shard(tensor, 1 if name.split(".")[-2] in _ROW_PARALLEL else 0)

    def _shard_span(self, name: str, shard: int | None) -> tuple[int, int] | None:
        """(offset, rows) of this rank's q/k/v or gate/up slice inside its fused parameter."""
        if shard is None:
            return None
        layer = self.layers[0]
        if "qkv_proj" in name:
            sizes = [layer.q_size, layer.kv_size, layer.kv_size]
        else:
            sizes = [layer.down_proj.in_features] * 2
        return sum(sizes[:shard]), sizes[shard]

    @staticmethod
    def _copy(param: nn.Parameter, tensor: torch.Tensor, span: tuple[int, int] | None) -> None:
        target = param.data if span is None else param.data.narrow(0, *span)
        if target.shape != tensor.shape:
            raise ModelLoadError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)
