"""Triton kernels for the decoder's elementwise ops (CUDA): residual-add + RMSNorm, q/k RMSNorm +
RoPE (optionally writing the step's keys and values to the paged KV cache), SiLU * up.

A decode step of a small model is dominated by launches, not bytes: in eager PyTorch one RMSNorm is
~6 kernels and RoPE ~12, per layer. Here each is one kernel, with the PyTorch versions' rounding
(layers/torch_ops.py).
"""

from __future__ import annotations

import torch

from paged_llm.layers.powers_of_two import next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the PyTorch versions (layers/torch_ops.py)
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, out_ptr, residual_out_ptr, weight_ptr,
        stride_x, stride_r, stride_o, stride_ro, size, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like a torch add
            tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        variance = tl.sum(x32 * x32, axis=0) / size
        normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        tl.store(
            out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask
        )

    @triton.jit
    def _norm_rope_heads(
        src, dst, stride_h, dst_stride_h, w_ptr, cos, sin, eps,
        NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        # All heads of one token as a [HEADS_P, HALF_BLOCK] tile per half; a head vector is handled
        # as its two halves, which is what rotate_half pairs up:
        #   out[:half] = x1 * cos - x2 * sin        out[half:] = x2 * cos + x1 * sin
        heads = tl.arange(0, HEADS_P)
        lo = tl.arange(0, HALF_BLOCK)
        mask = (heads[:, None] < NUM_HEADS) & (lo[None, :] < HALF)
        offs = heads[:, None] * stride_h + lo[None, :]
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
        dtype = x1.dtype
        if HAS_NORM:
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            rstd = tl.math.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
            w1 = tl.load(w_ptr + lo, mask=lo < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + lo, mask=lo < HALF, other=0.0).to(tl.float32)
            x1 = (w1[None, :] * (a * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
            x2 = (w2[None, :] * (b * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        # HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to the activation dtype.
        out1 = ((f1 * cos).to(dtype).to(tl.float32) + (-(f2 * sin)).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((f2 * cos).to(dtype).to(tl.float32) + (f1 * sin).to(dtype).to(tl.float32)).to(dtype)
        dst_offs = heads[:, None] * dst_stride_h + lo[None, :]
        out_dtype = dst.dtype.element_ty
        tl.store(dst + dst_offs, out1.to(out_dtype), mask=mask)
        tl.store(dst + HALF + dst_offs, out2.to(out_dtype), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr,
        positions_ptr, slot_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_qot, stride_qoh, stride_kot, stride_koh,
        stride_cb, stride_cs, stride_ch, stride_cs_pos, max_positions, eps,
        NUM_Q_HEADS: tl.constexpr, Q_HEADS_P: tl.constexpr, NUM_K_HEADS: tl.constexpr,
        K_HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
        WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    ):  # fmt: skip
        # One program per token, all its q and k heads: a program per (token, head) left a prefill
        # of 16k tokens at ~30% of memory bandwidth (400k programs of one warp each).
        # WRITE_KV: the rotated k and the v of the token go straight to their KV-cache slot
        # (k_out/v_out are the caches; slot < 0, a graph's padding row, writes nothing), which
        # saves the attention backend's separate cache-write kernel.
        token = tl.program_id(0).to(tl.int64)
        lo = tl.arange(0, HALF_BLOCK)
        position = tl.load(positions_ptr + token)
        cos = tl.load(cos_sin_ptr + position * stride_cs_pos + lo, mask=lo < HALF, other=0.0).to(tl.float32)
        sin_ptr = cos_sin_ptr + max_positions * stride_cs_pos + position * stride_cs_pos
        sin = tl.load(sin_ptr + lo, mask=lo < HALF, other=0.0).to(tl.float32)
        _norm_rope_heads(
            q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh, q_weight_ptr,
            cos[None, :], sin[None, :], eps, NUM_Q_HEADS, Q_HEADS_P, HALF, HALF_BLOCK, HAS_NORM,
        )  # fmt: skip
        if WRITE_KV:
            slot = tl.load(slot_ptr + token)
            if slot >= 0:
                cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                _norm_rope_heads(
                    k_ptr + token * stride_kt, k_out_ptr + cache_off, stride_kh, stride_ch, k_weight_ptr,
                    cos[None, :], sin[None, :], eps, NUM_K_HEADS, K_HEADS_P, HALF, HALF_BLOCK, HAS_NORM,
                )  # fmt: skip
                heads = tl.arange(0, K_HEADS_P)
                dims = tl.arange(0, HEAD_DIM_P)
                mask = (heads[:, None] < NUM_K_HEADS) & (dims[None, :] < HEAD_DIM)
                v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
                v_dst = v_out_ptr + cache_off + heads[:, None] * stride_ch + dims[None, :]
                tl.store(v_dst, v.to(v_out_ptr.dtype.element_ty), mask=mask)
        else:
            _norm_rope_heads(
                k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh,
                k_weight_ptr, cos[None, :], sin[None, :], eps, NUM_K_HEADS, K_HEADS_P, HALF, HALF_BLOCK,
                HAS_NORM,
            )  # fmt: skip

    @triton.jit
    def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < size
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds its result to the dtype
        tl.store(
            out_ptr + row * stride_out + cols,
            (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
            mask=mask,
        )


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, size = x.shape
    out = torch.empty_like(x)
    residual_in = residual if residual is not None else x
    residual_out = torch.empty_like(x) if residual is not None else x
    block = next_power_of_2(size)
    _rms_norm_kernel[(rows,)](
        x, residual_in, out, residual_out, weight,
        x.stride(0), residual_in.stride(0), out.stride(0), residual_out.stride(0),
        size, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip
    return out, residual_out


def qk_norm_rope_triton(q, k, q_weight, k_weight, eps, cos_sin, positions):
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, k.shape[1], head_dim), dtype=k.dtype, device=k.device)
    _launch_qk_norm_rope(q, k, None, q_out, k_out, None, q_weight, k_weight, eps, cos_sin, positions, None)
    return q_out, k_out


def qk_norm_rope_write_kv_triton(
    q, k, v, q_weight, k_weight, eps, cos_sin, positions, k_cache, v_cache, slot_mapping
):  # fmt: skip
    """qk_norm_rope_triton whose rotated k, and v, go to the KV cache at `slot_mapping` (< 0: none)
    instead of into a new tensor; returns q. The cache holds what write_kv_cache would write."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and v.stride(-1) == 1
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    _launch_qk_norm_rope(
        q, k, v, q_out, k_cache, v_cache, q_weight, k_weight, eps, cos_sin, positions, slot_mapping
    )
    return q_out


def _launch_qk_norm_rope(q, k, v, q_out, k_out, v_out, q_weight, k_weight, eps, cos_sin, positions, slots):
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return
    has_norm = q_weight is not None and k_weight is not None
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin.is_contiguous()
    half = head_dim // 2
    write_kv = slots is not None
    if write_kv:  # k_out / v_out: the caches [num_blocks, block_size, kv_heads, head_dim]
        stride_cb, stride_cs, stride_ch = k_out.stride(0), k_out.stride(1), k_out.stride(2)
        block_size, stride_kot, stride_koh = k_out.shape[1], 0, 0
    else:
        v, v_out, slots = k, k_out, positions  # never read: WRITE_KV is off
        stride_cb = stride_cs = stride_ch = 0
        block_size, stride_kot, stride_koh = 1, k_out.stride(0), k_out.stride(1)
    _qk_norm_rope_kernel[(num_tokens,)](
        q, k, v, q_out, k_out, v_out, q_weight if has_norm else q, k_weight if has_norm else k, cos_sin,
        positions, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), stride_kot, stride_koh,
        stride_cb, stride_cs, stride_ch, cos_sin.stride(1), cos_sin.shape[1], eps,
        NUM_Q_HEADS=num_q_heads, Q_HEADS_P=next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads, K_HEADS_P=next_power_of_2(num_k_heads),
        HALF=half, HALF_BLOCK=next_power_of_2(half), HAS_NORM=has_norm,
        WRITE_KV=write_kv, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_P=next_power_of_2(head_dim),
        num_warps=4 if num_q_heads * half >= 512 else 1,
    )  # fmt: skip


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    size = width // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(size))
    _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
    )
    return out
