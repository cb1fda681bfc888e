"""The PyTorch versions of the decoder's elementwise ops (CPU, NPU, and what torch.compile traces
for the decode step), and the "op, then the linear layer" compositions every path falls back to.
They follow HF transformers' rounding: float32 statistics, cast back to the activation dtype before
the weight multiply, RoPE products rounded in the activation dtype, so greedy outputs stay
token-identical to HF. The Triton kernels (triton_elementwise.py, triton_gemv.py) compute the same
thing in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from paged_llm.layers.fp8_linear import fp8_linear


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


def silu_mul_then_linear(
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    linear: Callable[..., torch.Tensor],
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(silu_and_mul(gate_up), weight) as two ops: what silu_mul_linear_triton fuses for one
    row, and what every other case runs. `weight_scale`: an FP8 weight's row scales (fp8_linear)."""
    if weight_scale is None:
        return linear(silu_and_mul(gate_up), weight)
    return linear(silu_and_mul(gate_up), weight, weight_scale=weight_scale)


def linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, or fp8_linear for an FP8 weight with its row scales."""
    if weight_scale is None:
        return F.linear(x, weight, bias)
    return fp8_linear(x, weight, weight_scale, bias)


silu_mul_linear_torch = functools.partial(silu_mul_then_linear, silu_and_mul_torch, linear_torch)


def norm_then_linear(
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    linear: Callable[..., torch.Tensor],
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x [+ residual])), the new residual) as two ops: what norm_linear_triton
    fuses for one row, and what every other case runs. `weight_scale`: as silu_mul_then_linear."""
    normed, residual_out = rms_norm(x, norm_weight, eps, residual)
    if weight_scale is None:
        return linear(normed, weight, bias), residual_out
    return linear(normed, weight, bias, weight_scale=weight_scale), residual_out
