"""Decode attention over a paged KV pool: one query token per sequence.

On CUDA this is a split-K Triton kernel (no gather of the context into a dense buffer) and a merge kernel;
elsewhere a gather + SDPA reference, which is also what the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton compiler
    triton = None

from ..executor.gpu_partition import current_sm_count
from . import fused


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [B, max_blocks];
    context_lens int32 [B] (including the current token) -> [B, Hq, D], written into `out` when given."""
    if fused.available(q):
        return _decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    result = decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` slots of each table's blocks: cache [num_blocks, block_size, Hkv, D], block_tables
    [..., max_blocks] -> [..., num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_tables[..., : -(-num_tokens // block_size)].long()
    return cache[blocks].flatten(-4, -3)[..., :num_tokens, :, :]


def decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    max_len = int(context_lens.max())
    k = gather_context(k_cache, block_tables, max_len)
    v = gather_context(v_cache, block_tables, max_len)
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    k = k.masked_fill(~mask[:, :, None, None], 0)  # slots past a context may hold anything, NaN included
    v = v.masked_fill(~mask[:, :, None, None], 0)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
    return out.squeeze(2)


# Contexts are split into chunks, each chunk one program, merged by log-sum-exp: with one program per (sequence,
# KV head) a batch of 64 at short contexts fills only 512 programs, too few to saturate HBM. Chunks are
# MAX_SPLIT_TOKENS long, or shorter where a batch has few (sequence, KV head) pairs for the SMs it runs on, so
# that a short context still spreads over them: PAIR_SM_TOKENS x pairs / SMs tokens (2 per pair on the H200's
# 132), a power of two from TOKENS_PER_ITER. The launch parameters and that rule are the fastest of sweeps on
# the whole H200 and on an 8-SM partition of it (bench/RESULTS.md).
MAX_SPLIT_TOKENS = 1024
PAIR_SM_TOKENS = 264
TOKENS_PER_ITER = 64
NUM_WARPS = 4
NUM_STAGES = 2


def split_tokens_for(pairs: int, num_sms: int) -> int:
    """Context tokens per program for a batch of `pairs` (sequence, KV head) pairs on `num_sms` SMs."""
    tokens = -(-PAIR_SM_TOKENS * pairs // num_sms)
    return min(MAX_SPLIT_TOKENS, 1 << max(0, tokens - 1).bit_length())


def _decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, out) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    tokens_per_iter = max(TOKENS_PER_ITER, block_size)
    split_tokens = max(tokens_per_iter, split_tokens_for(batch * num_kv_heads, current_sm_count(q.device)))
    # The table's width bounds every context: the split count is a function of shapes alone (CUDA graphs).
    num_splits = triton.cdiv(block_tables.shape[1] * block_size, split_tokens)
    if num_splits > 1:
        partial = torch.empty(batch, num_heads, num_splits, head_dim + 2, dtype=torch.float32, device=q.device)
    else:
        partial = out
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        partial,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TOKENS=tokens_per_iter,
        SPLIT_TOKENS=split_tokens,
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            partial,
            context_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            SPLIT_TOKENS=split_tokens,
            num_warps=4,
        )
    return out


if triton is not None:
    # The table's row stride and the split count vary with the batch's contexts: specialized on them (divisible by
    # 16 or not), the kernels would compile anew on a step that meets a new class.
    @triton.jit(do_not_specialize=["stride_tb"])
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        partial_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TOKENS: tl.constexpr,
        SPLIT_TOKENS: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One program = all query heads of one KV head of one sequence over one chunk of its context, with an
        online softmax. Split: writes (unnormalized output, max, sum) per head for the merge kernel."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx_len = tl.load(lens_ptr + seq)
        begin = split * SPLIT_TOKENS
        if SPLIT:
            if begin >= ctx_len:  # a chunk past the context (the grid spans the table's width): the merge skips it
                return
        end = tl.minimum(begin + SPLIT_TOKENS, ctx_len)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        head_ok = heads < GROUP
        q_heads = kv_head * GROUP + heads
        q = tl.load(
            q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        toks = tl.arange(0, TOKENS)
        for start in range(begin, end, TOKENS):
            pos = start + toks
            valid = pos < end
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
        if SPLIT:
            num_splits = tl.num_programs(2)
            row = ((seq * GROUP * tl.num_programs(1) + q_heads) * num_splits + split) * (HEAD_DIM + 2)
            tl.store(partial_ptr + row[:, None] + dims[None, :], acc, mask=head_ok[:, None])
            tl.store(partial_ptr + row + HEAD_DIM, m, mask=head_ok)
            tl.store(partial_ptr + row + HEAD_DIM + 1, denom, mask=head_ok)
        else:
            o_offs = seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptr + o_offs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(
        partial_ptr,
        lens_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        num_splits,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        SPLIT_TOKENS: tl.constexpr,
    ):
        """Log-sum-exp merge of one (sequence, query head)'s chunk results; chunks past the context are skipped."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        used = tl.cdiv(tl.load(lens_ptr + seq), SPLIT_TOKENS)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        ok = splits < used
        row = ((seq * tl.num_programs(1) + head) * num_splits + splits) * (HEAD_DIM + 2)
        m = tl.load(partial_ptr + row + HEAD_DIM, mask=ok, other=float("-inf"))
        denom = tl.load(partial_ptr + row + HEAD_DIM + 1, mask=ok, other=0.0)
        acc = tl.load(partial_ptr + row[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
        weight = tl.where(ok, tl.exp(m - tl.max(m, 0)), 0.0)
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(denom * weight, 0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))
