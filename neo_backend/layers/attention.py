"""Paged attention over the device KV pool.

One step's tokens are laid out as [prefill chunks | device decodes | host decodes]. Each token's k/v is
written into the paged pool at its slot; prefill chunks attend causally to their sequence's cached prefix
plus themselves (on CUDA through variable-length flash attention, FlashInfer's on Hopper where it is installed:
chunks that start their sequence side by side in one call, a chunk that continues a cached prompt in one of its
own); device decodes use the paged decode kernel (fused Triton kernel on CUDA, a gather + SDPA reference
elsewhere). Host decodes (NEO's CPU-requests) ride at the end of a sub-batch; their rows of the output are left
for the pipeline (pipeline.py) to fill from the CPU kernel.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import staging
from . import flashinfer_prefill, fused, paged_decode
from .rotary import RotaryEmbedding


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, num_heads, D], k and v [T, num_kv_heads, D]: views of a packed [T, (num_heads + 2 num_kv_heads) * D]
    tensor holding each token's q, k and v side by side, as the fused qkv projection leaves them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rows = qkv.shape[0]
    return q.view(rows, num_heads, head_dim), k.view(rows, num_kv_heads, head_dim), v.view(rows, num_kv_heads, head_dim)


@dataclass
class PrefillChunk:
    token_start: int  # offset of the chunk in the step's flat token list
    num_tokens: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # int32 [num_blocks] on the device


@dataclass
class PrefillRun:
    """Prefill chunks attended in one call: adjacent chunks that start their sequence (their keys are their own
    rows), or one chunk that continues a cached prompt (its keys are the sequence so far, read from the pool)."""

    span: slice  # the run's rows among the step's tokens
    lengths: list[int]  # each chunk's query rows, in order
    key_lengths: list[int]  # each chunk's key rows: its cached prefix and its own rows
    cu_seqlens_q: torch.Tensor  # int32 [chunks + 1] on the device: each chunk's first query row, then the end
    cu_seqlens_k: torch.Tensor  # int32 [chunks + 1]: each chunk's first key row, then the end
    continued: PrefillChunk | None = None  # the chunk whose prefix is cached; None for a run of new prompts


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_device_tokens]: pool slot of each device token's k/v
    prefills: list[PrefillChunk]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decodes], including the new token

    @property
    def num_decodes(self) -> int:
        return self.decode_context_lens.numel()

    @property
    def num_device_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    @functools.cached_property
    def prefill_runs(self) -> list[PrefillRun]:
        """The prefill chunks grouped into the calls that attend them; built once a step."""
        runs = []
        for fresh, group in itertools.groupby(self.prefills, key=lambda chunk: chunk.context_start == 0):
            chunks = list(group)
            runs += [_run_of(chunks)] if fresh else [_run_of([chunk]) for chunk in chunks]
        return runs


def _run_of(chunks: list[PrefillChunk]) -> PrefillRun:
    """One call's run: adjacent new prompts, or a single continued chunk."""
    lengths = [chunk.num_tokens for chunk in chunks]
    key_lengths = [chunk.context_start + chunk.num_tokens for chunk in chunks]
    bounds_q = list(itertools.accumulate(lengths, initial=0))
    bounds_k = list(itertools.accumulate(key_lengths, initial=0))
    cu_seqlens = staging.tensor_on(bounds_q + bounds_k, torch.int32, chunks[0].block_table.device)
    start = chunks[0].token_start
    return PrefillRun(
        slice(start, start + bounds_q[-1]),
        lengths,
        key_lengths,
        cu_seqlens[: len(bounds_q)],
        cu_seqlens[len(bounds_q) :],
        chunks[0] if chunks[0].context_start else None,
    )


def prefill_metadata(num_tokens: int, block_size: int, device: torch.device, num_prompts: int = 1) -> AttentionMetadata:
    """`num_prompts` new prompts of `num_tokens` tokens from position 0, each in its own run of the pool's first
    blocks: the shape the start-up measurements (one prompt) and the benchmarks give a prefill."""
    num_blocks = (num_tokens + block_size - 1) // block_size
    tables = torch.arange(num_prompts * num_blocks, dtype=torch.int32, device=device).view(num_prompts, num_blocks)
    first_slots = torch.arange(num_prompts, device=device).unsqueeze(1) * num_blocks * block_size
    return AttentionMetadata(
        slot_mapping=(first_slots + torch.arange(num_tokens, device=device)).flatten(),
        prefills=[PrefillChunk(i * num_tokens, num_tokens, 0, tables[i]) for i in range(num_prompts)],
        num_prefill_tokens=num_prompts * num_tokens,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
    )


class PagedAttention(torch.nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def store_rotated(
        self,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """RoPE on q [T, Hq, D] and k [T, Hkv, D] in place, and the device rows' k/v (the first len(slot_mapping)
        rows) into the pool at their slots: one fused kernel on CUDA. Host rows keep their q/k/v for the CPU."""
        if fused.available(q) and fused.rotary_supported(self.head_dim):
            fused.rotary_and_store_(
                positions, q, k, v, rotary.cos, rotary.sin, self.k_cache, self.v_cache, slot_mapping
            )
            return
        rotary(positions, q, k)
        num_dev = slot_mapping.numel()
        if num_dev:
            self._store(k[:num_dev], v[:num_dev], slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (rotated, device rows stored: `store_rotated`) -> [T, Hq, D], written into
        `out` where given: the device rows (prefills, GPU decodes); host rows of the result are left unset."""
        num_dev = meta.num_device_tokens
        out = torch.empty_like(q) if out is None else out
        for index, run in enumerate(meta.prefill_runs):
            keys, values = self._sequence_so_far(run.continued) if run.continued else (k[run.span], v[run.span])
            _prefill_run(q[run.span], keys, values, run, index, self.scale, out=out[run.span])
        if meta.num_decodes:
            span = slice(meta.num_prefill_tokens, num_dev)
            paged_decode.decode_attention(
                q[span],
                self.k_cache,
                self.v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                out=out[span],
            )
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, slot_mapping, k)
        flat_v.index_copy_(0, slot_mapping, v)

    def _sequence_so_far(self, chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v [context_start + num_tokens, Hkv, D] of a continued chunk's sequence, gathered from the pool."""
        total = chunk.context_start + chunk.num_tokens
        return (
            paged_decode.gather_context(self.k_cache, chunk.block_table, total),
            paged_decode.gather_context(self.v_cache, chunk.block_table, total),
        )


def _prefill_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: PrefillRun, index: int, scale: float, out: torch.Tensor
) -> None:
    """Each chunk of the step's `index`-th run attending causally to its keys into `out`: q and out [T, Hq, D], k/v
    [keys, Hkv, D]; a chunk's last query row sees all its keys (causal from the bottom right). On CUDA in fp16/bf16
    one call over the packed rows (grouped K/V heads as they are): FlashInfer's where it runs
    (`flashinfer_prefill`), else torch's flash attention; elsewhere an SDPA call per chunk. Against a call per
    chunk, 8 x 1000 tokens prefill 1.06x and 64 x 100 1.7x faster on the H200, and 3 x 7000 (two chunks
    continuing) 1.37x on an H100 (bench/RESULTS.md)."""
    if _flash_supported(q):
        prefill = flashinfer_prefill.for_shape(q, k)
        if prefill is not None:
            prefill.attend(index, run, q, k, v, scale, out=out)
            return
        result, *_ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            run.cu_seqlens_q,
            run.cu_seqlens_k,
            max(run.lengths),
            max(run.key_lengths),
            0.0,
            True,
            False,
            scale=scale,
        )
        out.copy_(result)
        return
    for q_chunk, k_chunk, v_chunk, out_chunk in zip(
        q.split(run.lengths), k.split(run.key_lengths), v.split(run.key_lengths), out.split(run.lengths)
    ):
        out_chunk.copy_(_sdpa(q_chunk, k_chunk, v_chunk, mask=_bottom_right_causal_mask(q_chunk, k_chunk), scale=scale))


def _bottom_right_causal_mask(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """None where queries and keys are the same rows (SDPA's own causal mask), else query row i sees keys up to
    i + (keys - queries)."""
    num_q, num_k = q.shape[0], k.shape[0]
    if num_q == num_k:
        return None
    rows = torch.arange(num_q, device=q.device).unsqueeze(1) + (num_k - num_q)
    return torch.arange(num_k, device=q.device).unsqueeze(0) <= rows


def _flash_supported(q: torch.Tensor) -> bool:
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and _compute_capability(q.device.index)[0] >= 8
    )


@functools.cache
def _compute_capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


# cuDNN's attention builds a graph for every new sequence length it meets: ~75-80 ms on an H100 (once ~1 s), a
# stall of the whole step for each prompt of a length not seen before. Flash attention has no such cost.
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal (mask=None) or masked attention of one sequence: q [Tq, Hq, D], k/v [Tk, Hkv, D]. SDPA's fused
    CUDA kernels need 4-D inputs. The causal one takes grouped K/V heads as they are (`enable_gqa`: flash
    attention on CUDA); the masked one has no fused kernel for them, so K/V heads are repeated there."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and mask is not None:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    with sdpa_kernel(_PREFILL_BACKENDS):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1 and mask is None
        )
    return out.squeeze(0).transpose(0, 1)
