"""Linear layers over FP8 (e4m3) weights kept in FP8, with one float32 scale per output row
(weight[n, k] = fp8[n, k] x scale[n]): per-channel checkpoints as they are, per-tensor ones with
their scalar repeated, `quantization: fp8` quantized per channel at load.

- One row (batch-1 decode) on CUDA: the Triton GEMVs of layers/triton_gemv.py read the FP8 bytes
  (half of bf16's) and apply the row scale to their float32 sums (W8A16: the activations stay in
  the model dtype).
- More rows on CUDA (sm90): W8A8 through cuBLASLt (`torch._scaled_mm`, row-wise scales), the
  activations quantized per token at run time (dynamic, as vLLM's and the FP8-dynamic checkpoints'
  recipe): `quantize_rows`.
- Anywhere else (CPU tests, a shape _scaled_mm does not take): the weight dequantized for the call,
  F.linear over exactly the values a load-time dequantization gives.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from paged_llm.layers.fp8_format import E4M3, E4M3_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch versions
    triton = None

FP8_WEIGHTS_ENV = "PAGED_LLM_FP8_WEIGHTS"
# _scaled_mm's FP8 operands need K and N to be multiples of 16.
SCALED_MM_ALIGN = 16
# A row's amax below this quantizes with this instead (an all-zero row: any scale gives zeros).
MIN_ACTIVATION_AMAX = 1e-6
QUANTIZE_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, K, x_stride, q_stride, min_amax, fp8_max, BLOCK: tl.constexpr
    ):  # fmt: skip
        """One row per program: its largest magnitude, then the row / (amax / fp8_max) clamped and
        cast (two passes over the row; rows are short next to the GEMM that reads them)."""
        row = tl.program_id(0)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * x_stride + cols, mask=cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), min_amax) / fp8_max
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * x_stride + cols, mask=cols < K, other=0.0)
            q = tl.clamp(x.to(tl.float32) / scale, -fp8_max, fp8_max)
            tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)


def fp8_weights_stay_fp8(device: torch.device) -> bool:
    """FP8 weights stay FP8 here: CUDA with Hopper's FP8 row-wise GEMMs (sm90 and later) and Triton.
    FP8_WEIGHTS_ENV overrides: "dequantize" (bf16 speed, an A/B), "keep" (any device: the layer
    dequantizes for each call where it has no kernel; tests of the kept layout on CPU)."""
    override = os.environ.get(FP8_WEIGHTS_ENV, "")
    if override not in ("", "keep", "dequantize"):
        raise ValueError(f"{FP8_WEIGHTS_ENV} must be keep or dequantize, got {override!r}")
    if override:
        return override == "keep"
    if device.type != "cuda" or triton is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scales [M, 1]) with x ~= fp8 x scale per row: each row's largest
    magnitude maps to 448. One Triton kernel on CUDA, torch ops elsewhere."""
    num_rows, k = x.shape
    if triton is not None and x.is_cuda and x.stride(1) == 1:
        quantized = torch.empty((num_rows, k), dtype=E4M3, device=x.device)
        scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
        if num_rows:
            _quantize_rows_kernel[(num_rows,)](
                x, quantized, scales, k, x.stride(0), quantized.stride(0), MIN_ACTIVATION_AMAX, E4M3_MAX,
                BLOCK=QUANTIZE_BLOCK,
            )  # fmt: skip
        return quantized, scales
    values = x.to(torch.float32)
    scales = values.abs().amax(dim=1, keepdim=True).clamp(min=MIN_ACTIVATION_AMAX) / E4M3_MAX
    return (values / scales).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scales


def dequantized_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model-dtype weight a load-time dequantization gives: fp8 x row scale in float32, rounded once."""
    return (weight.to(torch.float32) * weight_scale.to(torch.float32).view(-1, 1)).to(dtype)


def scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and k % SCALED_MM_ALIGN == 0
        and n % SCALED_MM_ALIGN == 0
    )


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear over the FP8 weight: W8A8 on CUDA (per-token activation scales), else the weight
    dequantized for the call. `x` [..., K]; `weight` [N, K] fp8; `weight_scale` [N] float32."""
    assert weight.dtype == E4M3 and weight_scale.shape == (weight.shape[0],)
    if not scaled_mm_applies(x, weight):
        return F.linear(x, dequantized_weight(weight, weight_scale, x.dtype), bias)
    leading = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    quantized, scales = quantize_rows(rows)
    out = torch._scaled_mm(
        quantized, weight.t(), scale_a=scales, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype
    )
    if bias is not None:  # not _scaled_mm's own: not every build takes a bias with row-wise scales
        out = out + bias
    return out.view(*leading, weight.shape[0])
