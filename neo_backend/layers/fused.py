"""Fused Triton kernels for the CUDA path of the elementwise layers: add + RMSNorm, RoPE with the k/v store into
the paged pool, SiLU-and-mul.

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
