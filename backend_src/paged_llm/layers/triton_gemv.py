"""One-row GEMV kernels (CUDA, 16-bit dtypes) for the linear layers of batch-1 decode: the plain
GEMV, and the two with the op before them folded in (residual-add + RMSNorm + GEMV for q/k/v and
gate/up, SiLU * up + GEMV for down). At one row cuBLAS reads small weights at ~1 TB/s (H100); these
stream them at 2-4 TB/s. Launch settings per kernel, shape and card: layers/gemv_tuning.py. Any
other case (more rows, float32, a bias) takes the separate ops.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the PyTorch versions (layers/torch_ops.py)
    triton = None

from paged_llm.layers.fp8_format import E4M3
from paged_llm.layers.gemv_tuning import FP8_PREFIX, gemv_config
from paged_llm.layers.powers_of_two import next_power_of_2
from paged_llm.layers.torch_ops import linear_torch, norm_then_linear
from paged_llm.layers.triton_elementwise import rms_norm_triton, silu_and_mul_triton

if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, N, K,
        W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y[n] = sum_k w[n, k] * x[k] for one row x; each program streams BLOCK_N rows of w.
        CUDA cores, float32 accumulation: at one row cuBLAS reads small weights at ~1 TB/s (H100).
        W_SCALED: w is FP8 and row n's sum is multiplied by s[n] (its dequantization scale)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptr + offs_k)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if W_SCALED:
            y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _silu_mul_gemv_kernel(
        gu_ptr, w_ptr, s_ptr, y_ptr, N, K,
        W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
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
        y = tl.sum(acc, axis=1)
        if W_SCALED:
            y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _norm_gemv_kernel(
        x_ptr, r_ptr, norm_w_ptr, w_ptr, s_ptr, y_ptr, r_out_ptr, N, K, eps,
        HAS_RESIDUAL: tl.constexpr, W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        K_P: tl.constexpr,
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
        y = tl.sum(acc, axis=1)
        if W_SCALED:
            y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _gemv_applies(
    x: torch.Tensor, weight: torch.Tensor, k: int, block_k: int, weight_scale: torch.Tensor | None = None
) -> bool:
    """One contiguous row of a 16-bit dtype, K a multiple of the block, a weight of the row's dtype
    (or FP8 with its row scales; block-scaled FP8 goes to fp8_linear): where the GEMVs beat cuBLAS."""
    return (
        x.shape[0] == 1
        and x.dtype in (torch.float16, torch.bfloat16)
        and (
            weight.dtype == x.dtype
            if weight_scale is None
            else weight.dtype == E4M3 and weight_scale.dim() == 1
        )
        and k % block_k == 0
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def _kernel(name: str, weight_scale: torch.Tensor | None) -> str:
    """The kernel's name in the GEMV tables (layers/gemv_tuning.py): FP8 weights have their own."""
    return name if weight_scale is None else FP8_PREFIX + name


def silu_mul_linear_triton(
    gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(silu_and_mul(gate_up), weight): one kernel for one row (see _silu_mul_gemv_kernel),
    else the two ops. `weight_scale`: an FP8 weight's row scales."""
    k = gate_up.shape[1] // 2
    n = weight.shape[0]
    config = gemv_config(n, k, weight.device, _kernel("silu_mul_gemv", weight_scale))
    if not _gemv_applies(gate_up, weight, k, config.block_k, weight_scale) or weight.shape[1] != k:
        return linear_triton(silu_and_mul_triton(gate_up), weight, weight_scale=weight_scale)
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        gate_up, weight, weight_scale if weight_scale is not None else weight, out, n, k,
        W_SCALED=weight_scale is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, with a Triton GEMV for one row of a 16-bit dtype and no bias (batch-1 decode).
    Measured on an H100 inside CUDA graphs (scripts/_diag/gemv_bench.py, Qwen3-0.6B shapes):
    1.3-1.9x faster than cuBLAS per layer GEMM at one row, no faster at 4-16 rows, so more rows and
    float32 (HF parity) stay on cuBLAS. `weight_scale`: an FP8 weight's row scales (the GEMV at
    one row, else layers/fp8_linear.py)."""
    k = x.shape[1]
    n = weight.shape[0]
    config = gemv_config(n, k, weight.device, _kernel("gemv", weight_scale))
    if bias is not None or not _gemv_applies(x, weight, k, config.block_k, weight_scale):
        return linear_torch(x, weight, bias, weight_scale)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight_scale if weight_scale is not None else weight, out, n, k,
        W_SCALED=weight_scale is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x [+ residual]), weight, bias), the new residual): one kernel for one row of
    a 16-bit dtype (_norm_gemv_kernel), else rms_norm_triton then linear_triton. `weight_scale`:
    an FP8 weight's row scales."""
    k = x.shape[1]
    n = weight.shape[0]
    config = gemv_config(n, k, weight.device, _kernel("norm_gemv", weight_scale))
    if (
        bias is not None
        or not _gemv_applies(x, weight, k, config.block_k, weight_scale)
        or norm_weight.dtype != x.dtype
    ):
        return norm_then_linear(
            rms_norm_triton, linear_triton, x, residual, norm_weight, eps, weight, bias, weight_scale
        )
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    _norm_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm_weight, weight,
        weight_scale if weight_scale is not None else weight, out, residual_out, n, k, eps,
        HAS_RESIDUAL=residual is not None, W_SCALED=weight_scale is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        K_P=next_power_of_2(k), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, residual_out
