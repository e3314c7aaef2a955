"""Decode attention over a paged KV pool: one query token per sequence.

On CUDA this is one fused Triton kernel (no gather of the context into a dense buffer); elsewhere a gather +
SDPA reference, which is also what the kernel is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton compiler
    triton = None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [B, max_blocks];
    context_lens int32 [B] (including the current token) -> [B, Hq, D]."""
    if q.is_cuda and triton is not None:
        return _decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    block_size = k_cache.shape[1]
    max_len = int(context_lens.max())
    tables = block_tables[:, : (max_len + block_size - 1) // block_size].long()
    k = k_cache[tables].flatten(1, 2)[:, :max_len]
    v = v_cache[tables].flatten(1, 2)[:, :max_len]
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    k = k.masked_fill(~mask[:, :, None, None], 0)  # slots past a context may hold anything, NaN included
    v = v.masked_fill(~mask[:, :, None, None], 0)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=q.shape[1] != k.shape[2])
    return out.squeeze(2)


def _decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    tokens_per_iter = max(64, block_size)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TOKENS=tokens_per_iter,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    return out


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                             stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One program = all query heads of one KV head of one sequence; online softmax over the context."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx_len = tl.load(lens_ptr + seq)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        head_ok = heads < GROUP
        q_offs = seq * stride_qb + (kv_head * GROUP + heads)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=head_ok[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        toks = tl.arange(0, TOKENS)
        for start in range(0, ctx_len, TOKENS):
            pos = start + toks
            valid = pos < ctx_len
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_offs = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + kv_offs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_offs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        out = acc / denom[:, None]
        o_offs = seq * stride_ob + (kv_head * GROUP + heads)[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
