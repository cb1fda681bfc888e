"""Fused elementwise kernels for the decoder: residual-add + RMSNorm, q/k RMSNorm + RoPE, SiLU * up;
and a GEMV for the linear layers of a one-row batch (batch-1 decode) in 16-bit dtypes.

A decode step of a small model is dominated by launches, not bytes: in eager PyTorch one RMSNorm is
~6 kernels and RoPE ~12, per layer. Here each is one Triton kernel on CUDA. The PyTorch versions
(CPU, NPU) compute the same thing in the same order; both follow HF transformers' rounding: float32
statistics, cast back to the activation dtype before the weight multiply, RoPE products rounded in
the activation dtype, so greedy outputs stay token-identical to HF.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from paged_llm.layers.cpu_linear import onednn_linear
from paged_llm.layers.gemv_tuning import gemv_config

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the PyTorch versions
    triton = None


# ------------------------------------------------------------------------------ PyTorch versions
def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual the second is x."""
    if residual is not None:
        x = x + residual
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos_sin: torch.Tensor,  # [2, max_positions, D] in the activation dtype
    positions: torch.Tensor,  # [T]
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None and k_weight is not None:
        q = rms_norm_torch(q, q_weight, eps)[0]
        k = rms_norm_torch(k, k_weight, eps)[0]
    cos = cos_sin[0].index_select(0, positions)[:, None, :]
    sin = cos_sin[1].index_select(0, positions)[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------------------- Triton kernels
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

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[n] = sum_k w[n, k] * x[k] for one row x; each program streams BLOCK_N rows of w.
        CUDA cores, float32 accumulation: at one row cuBLAS reads small weights at ~1 TB/s (H100)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptr + offs_k)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _silu_mul_gemv_kernel(gu_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[n] = sum_k w[n, k] * (silu(gate[k]) * up[k]) for one row gate_up = [gate | up] of width
        2K: the MLP's activation and its down projection in one kernel (batch-1 decode). Each
        program recomputes the activation of the whole row (K exps, cheap next to its BLOCK_N x K
        weights) with the roundings of _silu_and_mul_kernel, so the result equals the two kernels'
        where both launch with the same settings (a table may give them different BLOCK_K, which
        sums in another order)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            gate = tl.load(gu_ptr + offs_k)
            up = tl.load(gu_ptr + K + offs_k)
            g = gate.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
            x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _norm_gemv_kernel(
        x_ptr, r_ptr, norm_w_ptr, w_ptr, y_ptr, r_out_ptr, N, K, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_P: tl.constexpr,
    ):  # fmt: skip
        """y = w @ rms_norm(x [+ residual]) for one row: the decoder's residual-add + RMSNorm and the
        projection after it in one kernel (batch-1 decode). Every program computes the row's
        statistic the way _rms_norm_kernel does (the whole row in one tl.sum) and recomputes its
        normalized chunks with the same roundings; program 0 also writes the new residual."""
        pid = tl.program_id(0)
        cols = tl.arange(0, K_P)
        col_mask = cols < K
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + cols, mask=col_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like a torch add
            tl.store(r_out_ptr + cols, x, mask=col_mask & (pid == 0))
        x32 = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / K + eps)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            xk = tl.load(x_ptr + offs_k)
            if HAS_RESIDUAL:
                rk = tl.load(r_ptr + offs_k)
                xk = (xk.to(tl.float32) + rk.to(tl.float32)).to(xk.dtype)
            normed = (xk.to(tl.float32) * rstd).to(xk.dtype)
            norm_w = tl.load(norm_w_ptr + offs_k)
            h = (norm_w.to(tl.float32) * normed.to(tl.float32)).to(xk.dtype)
            acc += w.to(tl.float32) * h.to(tl.float32)[None, :]
        tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, k: int, block_k: int) -> bool:
    """One contiguous row of a 16-bit dtype, K a multiple of the block: where the GEMVs beat cuBLAS."""
    return (
        x.shape[0] == 1
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and k % block_k == 0
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def silu_mul_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu_and_mul(gate_up), weight): one kernel for one row (see _silu_mul_gemv_kernel),
    else the two ops."""
    k = gate_up.shape[1] // 2
    n = weight.shape[0]
    config = gemv_config(n, k, weight.device, "silu_mul_gemv")
    if not _gemv_applies(gate_up, weight, k, config.block_k) or weight.shape[1] != k:
        return linear_triton(silu_and_mul_triton(gate_up), weight)
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        gate_up, weight, out, n, k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def silu_mul_then_linear(
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    linear: Callable[..., torch.Tensor],
    gate_up: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """linear(silu_and_mul(gate_up), weight) as two ops: what silu_mul_linear_triton fuses for one
    row, and what every other case runs."""
    return linear(silu_and_mul(gate_up), weight)


silu_mul_linear_torch = functools.partial(silu_mul_then_linear, silu_and_mul_torch, F.linear)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a Triton GEMV for one row of a 16-bit dtype and no bias (batch-1 decode).
    Measured on an H100 inside CUDA graphs (scripts/_diag/gemv_bench.py, Qwen3-0.6B shapes):
    1.3-1.9x faster than cuBLAS per layer GEMM at one row, no faster at 4-16 rows, so more rows and
    float32 (HF parity) stay on cuBLAS."""
    k = x.shape[1]
    n = weight.shape[0]
    config = gemv_config(n, k, weight.device)
    if bias is not None or not _gemv_applies(x, weight, k, config.block_k):
        return F.linear(x, weight, bias)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out, n, k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def norm_then_linear(
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    linear: Callable[..., torch.Tensor],
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x [+ residual])), the new residual) as two ops: what norm_linear_triton
    fuses for one row, and what every other case runs."""
    normed, residual_out = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), residual_out


def norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x [+ residual]), weight, bias), the new residual): one kernel for one row of
    a 16-bit dtype (_norm_gemv_kernel), else rms_norm_triton then linear_triton."""
    k = x.shape[1]
    n = weight.shape[0]
    config = gemv_config(n, k, weight.device, "norm_gemv")
    if bias is not None or not _gemv_applies(x, weight, k, config.block_k) or norm_weight.dtype != x.dtype:
        return norm_then_linear(rms_norm_triton, linear_triton, x, residual, norm_weight, eps, weight, bias)
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    _norm_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, out, residual_out, n, k, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        K_P=triton.next_power_of_2(k), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, residual_out


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, size = x.shape
    out = torch.empty_like(x)
    residual_in = residual if residual is not None else x
    residual_out = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(size)
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
        NUM_Q_HEADS=num_q_heads, Q_HEADS_P=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads, K_HEADS_P=triton.next_power_of_2(num_k_heads),
        HALF=half, HALF_BLOCK=triton.next_power_of_2(half), HAS_NORM=has_norm,
        WRITE_KV=write_kv, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        num_warps=4 if num_q_heads * half >= 512 else 1,
    )  # fmt: skip


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    size = width // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
    )
    return out


class FusedOps:
    """The decoder's elementwise ops: Triton kernels when `use_triton`, else the PyTorch versions.
    The decoder's modules share one instance and read its ops at every call."""

    def __init__(self, use_triton: bool, use_gemv: bool = True, use_onednn: bool = False) -> None:
        """`use_onednn`: float32 linear layers on CPU through oneDNN (layers/cpu_linear.py)."""
        self._settings = (use_triton, use_gemv, use_onednn)
        self._bind(*self._settings)

    def _bind(self, use_triton: bool, use_gemv: bool, use_onednn: bool) -> None:
        self.use_triton = use_triton and triton is not None
        self.rms_norm = rms_norm_triton if self.use_triton else rms_norm_torch
        self.qk_norm_rope = qk_norm_rope_triton if self.use_triton else qk_norm_rope_torch
        # With an attention backend that reads a cache written here (TritonAttention.attend).
        self.qk_norm_rope_write_kv = qk_norm_rope_write_kv_triton if self.use_triton else None
        self.silu_and_mul = silu_and_mul_triton if self.use_triton else silu_and_mul_torch
        self.linear = linear_triton if self.use_triton and use_gemv else F.linear
        # The LM head: cuBLAS on CUDA (the Triton GEMV was measured on the layers' shapes only).
        self.lm_head_linear: Callable[..., torch.Tensor] = F.linear
        if not self.use_triton and use_onednn:
            self.linear = self.lm_head_linear = onednn_linear
        self.norm_linear = functools.partial(norm_then_linear, self.rms_norm, self.linear)
        if self.use_triton and use_gemv:  # one kernel each for a one-row batch
            self.norm_linear = norm_linear_triton
            self.silu_mul_linear = silu_mul_linear_triton
        else:
            self.silu_mul_linear = functools.partial(silu_mul_then_linear, self.silu_and_mul, self.linear)

    @contextlib.contextmanager
    def pytorch_ops(self) -> Iterator[None]:
        """Inside: the PyTorch versions of every op (what torch.compile traces and generates its own
        kernels for, runner/decode_compile.py); after: the ops this instance was built with."""
        self._bind(use_triton=False, use_gemv=False, use_onednn=False)
        try:
            yield
        finally:
            self._bind(*self._settings)
