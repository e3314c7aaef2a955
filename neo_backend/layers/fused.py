"""Fused Triton kernels for the CUDA path of the elementwise layers: add + RMSNorm, RoPE with the k/v store into
the paged pool, SiLU-and-mul, and greedy sampling.

Eager PyTorch spends about ten kernels on each of these (casts, reductions, `cat`); at decode batch sizes
every kernel is launch-bound, so fusing them takes ~40 kernels out of each layer. Each kernel computes in
fp32 like its PyTorch reference in the layer module, which is what runs on CPU and what the tests compare.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton compiler
    triton = None


def available(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); the sum is rounded to x's dtype first, as in PyTorch."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    res = residual.contiguous() if residual is not None else x
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](
        x,
        res,
        weight,
        out,
        new_residual,
        cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(4, block // 512)),
    )
    return out, new_residual


def rotary_and_store_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Rotate-half RoPE applied in place to q [T, Hq, D] and k [T, Hkv, D] (rows may be strided views), and the
    first len(slots) rows' rotated k and their v [T, Hkv, D] stored into the paged pool ([blocks, block_size, Hkv,
    D]) at those slots: the store costs no launch of its own."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if tokens == 0:
        return
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        slots.numel(),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        HQ=num_q_heads,
        HK=num_kv_heads,
        HQ_PAD=triton.next_power_of_2(num_q_heads),
        HK_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        num_warps=4,
    )


def rotary_supported(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half & (half - 1) == 0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(half, block))](gate_up, out, half, BLOCK=block, num_warps=4)
    return out


GREEDY_CHUNK = 4096  # logits per program of the greedy sampler's first pass


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` [B, V]: whether every entry is finite, the argmax (the first of ties, as
    `torch.argmax`) and its log-softmax, in fp32 and one read of the logits (against ~8 kernels and 3 passes over
    an fp32 copy for `log_softmax`, `isfinite` and `argmax`). Each row is read in chunks by programs of their
    own (one program per row reads too slowly at decode batch sizes), then one program per row merges them."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, GREEDY_CHUNK)
    device = logits.device
    chunk_max = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    chunk_index = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    chunk_sum = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    chunk_bad = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    _greedy_chunk_kernel[(rows, chunks)](
        logits, chunk_max, chunk_index, chunk_sum, chunk_bad, vocab, chunks, CHUNK=GREEDY_CHUNK, num_warps=4
    )
    finite = torch.empty(rows, dtype=torch.bool, device=device)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    _greedy_merge_kernel[(rows,)](
        chunk_max,
        chunk_index,
        chunk_sum,
        chunk_bad,
        finite,
        tokens,
        logprobs,
        chunks,
        CHUNKS_PAD=triton.next_power_of_2(chunks),
    )
    return finite, tokens, logprobs


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * cols + offs, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * cols + offs, x, mask=mask)
        x = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, 0) / cols + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * cols + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_heads(ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
        """Rotates the heads at `ptr` in place; returns the rotated halves (fp32) and the heads' mask."""
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HALF)
        mask = (heads < NUM_HEADS)[:, None]
        lo = ptr + heads[:, None] * stride_h + dims[None, :]
        x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        tl.store(lo, y1.to(ptr.dtype.element_ty), mask=mask)
        tl.store(lo + HALF, y2.to(ptr.dtype.element_ty), mask=mask)
        return y1, y2, mask

    @triton.jit
    def _rotary_kernel(
        pos_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        num_slots,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cs,
        HQ: tl.constexpr,
        HK: tl.constexpr,
        HQ_PAD: tl.constexpr,
        HK_PAD: tl.constexpr,
        HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + token)
        dims = tl.arange(0, HALF)
        cos = tl.load(cos_ptr + pos * stride_cs + dims)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cs + dims)[None, :]
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, HQ, HQ_PAD, HALF)
        k1, k2, mask = _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, HK, HK_PAD, HALF)
        if token < num_slots:
            heads = tl.arange(0, HK_PAD)
            row = tl.load(slots_ptr + token) * (HK * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
            tl.store(k_cache_ptr + row, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + row + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v_lo = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
            tl.store(v_cache_ptr + row, tl.load(v_lo, mask=mask, other=0.0), mask=mask)
            tl.store(v_cache_ptr + row + HALF, tl.load(v_lo + HALF, mask=mask, other=0.0), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < half
        gate = tl.load(x_ptr + row * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * half + half + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * half + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _greedy_chunk_kernel(logits_ptr, max_ptr, index_ptr, sum_ptr, bad_ptr, vocab, chunks, CHUNK: tl.constexpr):
        """One chunk of one row: its max and the max's first index, the sum of exp(x - max), and how many entries
        are not finite (their row's request fails; its values do not matter)."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * vocab + offs, mask=mask, other=-float("inf")).to(tl.float32)
        best = tl.max(x, 0)
        out = row * chunks + chunk
        tl.store(max_ptr + out, best)
        tl.store(index_ptr + out, tl.argmax(x, 0) + chunk * CHUNK)
        tl.store(sum_ptr + out, tl.sum(tl.exp(x - best), 0))
        tl.store(bad_ptr + out, tl.sum((((x != x) | (tl.abs(x) == float("inf"))) & mask).to(tl.int32), 0))

    @triton.jit
    def _greedy_merge_kernel(
        max_ptr, index_ptr, sum_ptr, bad_ptr, finite_ptr, token_ptr, logprob_ptr, chunks, CHUNKS_PAD: tl.constexpr
    ):
        """A row's chunks merged: the first chunk holding the row's max gives the token (the first of ties), and
        the sums rescaled to that max give the log-softmax."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CHUNKS_PAD)
        mask = offs < chunks
        maxes = tl.load(max_ptr + row * chunks + offs, mask=mask, other=-float("inf"))
        best = tl.max(maxes, 0)
        first = tl.argmax(maxes, 0)
        sums = tl.load(sum_ptr + row * chunks + offs, mask=mask, other=0.0)
        total = tl.sum(tl.where(mask, sums * tl.exp(maxes - best), 0.0), 0)
        bad = tl.sum(tl.load(bad_ptr + row * chunks + offs, mask=mask, other=0), 0)
        tl.store(finite_ptr + row, bad == 0)
        tl.store(token_ptr + row, tl.load(index_ptr + row * chunks + first).to(tl.int64))
        tl.store(logprob_ptr + row, -tl.log(total))
