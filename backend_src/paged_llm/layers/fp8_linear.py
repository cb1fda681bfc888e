"""Linear layers over FP8 (e4m3) weights kept in FP8, with one float32 scale per output row
(weight[n, k] = fp8[n, k] x scale[n]): per-channel checkpoints as they are, per-tensor ones with
their scalar repeated, `quantization: fp8` quantized per channel at load. Block-scaled checkpoints
(128 x 128 blocks: Qwen3-*-FP8) keep a scale per row and 128 columns instead (`weight_scale`
[N, ceil(K / 128)], a block's scale repeated for its rows): block_scaled_linear.

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
from collections.abc import Iterable
from dataclasses import dataclass

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
# Block-scaled weights: the columns a scale covers (the checkpoints' blocks are 128 x 128), and the
# activations' group: a scale per token and 128 columns, as the checkpoints' recipe (DeepSeek's).
GROUP_COLUMNS = 128
# cuBLASLt's block-scaled FP8 GEMM wants the activations' rows padded to 4 (and on some builds
# the groups a row has: block_scaled_mm_takes).
SCALED_MM_ROW_PAD = 4

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

    @triton.jit
    def _quantize_groups_kernel(
        x_ptr, q_ptr, scale_ptr, num_rows, x_stride, q_stride, scale_group_stride, min_amax, fp8_max,
        GROUP: tl.constexpr,
    ):  # fmt: skip
        """One (row, group of GROUP columns) per program: its largest magnitude, then the values /
        (amax / fp8_max) clamped and cast. Rows past num_rows (the padding) write zeros."""
        row = tl.program_id(0)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        x = tl.load(x_ptr + row * x_stride + cols, mask=(cols >= 0) & (row < num_rows), other=0.0)
        x = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax) / fp8_max
        tl.store(scale_ptr + row + group * scale_group_stride, scale)
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty))


def fp8_weights_stay_fp8(device: torch.device, block_scaled_in_features: Iterable[int] | None = None) -> bool:
    """FP8 weights stay FP8 here: CUDA with Hopper's FP8 row-wise GEMMs (sm90 and later) and Triton;
    block-scaled weights (of these input widths) where cuBLASLt's block-scaled GEMM takes them
    (block_scaled_mm_takes).
    FP8_WEIGHTS_ENV overrides: "dequantize" (bf16 speed, an A/B), "keep" (any device: the layer
    dequantizes for each call where it has no kernel; tests of the kept layout on CPU)."""
    override = os.environ.get(FP8_WEIGHTS_ENV, "")
    if override not in ("", "keep", "dequantize"):
        raise ValueError(f"{FP8_WEIGHTS_ENV} must be keep or dequantize, got {override!r}")
    if override:
        return override == "keep"
    if device.type != "cuda" or triton is None or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    if block_scaled_in_features is None:
        return True
    return all(block_scaled_mm_takes(device, k) for k in block_scaled_in_features)


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
    dequantized for the call. `x` [..., K]; `weight` [N, K] fp8; `weight_scale` [N] float32, or
    [N, ceil(K / 128)] for a block-scaled weight (block_scaled_linear)."""
    if weight_scale.dim() == 2:
        return block_scaled_linear(x, weight, weight_scale, bias)
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


# ------------------------------------------------------------------------------------ block-scaled
def group_dequantized_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The model-dtype weight of a block-scaled one: fp8 x its group's scale in float32, rounded
    once (the values a load-time dequantization gives)."""
    k = weight.shape[1]
    scales = weight_scale.to(torch.float32).repeat_interleave(GROUP_COLUMNS, dim=1)[:, :k]
    return (weight.to(torch.float32) * scales).to(dtype)


def quantize_groups(x: torch.Tensor, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M', K], float32 scales [M', K / 128] stored column-major) with x ~= fp8 x scale per
    row and 128 columns; M' is M padded to a multiple of `pad_rows_to` with zero rows."""
    num_rows, k = x.shape
    padded_rows = -(-num_rows // pad_rows_to) * pad_rows_to
    if triton is not None and x.is_cuda and x.stride(1) == 1:  # one kernel (inside the CUDA graphs)
        quantized = torch.empty((padded_rows, k), dtype=E4M3, device=x.device)
        scales = torch.empty((k // GROUP_COLUMNS, padded_rows), dtype=torch.float32, device=x.device).t()
        assert k % GROUP_COLUMNS == 0, f"{k} columns are no whole number of groups"
        if padded_rows:
            _quantize_groups_kernel[(padded_rows, k // GROUP_COLUMNS)](
                x, quantized, scales, num_rows, x.stride(0), k, padded_rows, MIN_ACTIVATION_AMAX, E4M3_MAX,
                GROUP=GROUP_COLUMNS,
            )  # fmt: skip
        return quantized, scales
    values = x.to(torch.float32)
    if padded_rows != num_rows:
        values = F.pad(values, (0, 0, 0, padded_rows - num_rows))
    groups = values.view(padded_rows, k // GROUP_COLUMNS, GROUP_COLUMNS)
    scales = groups.abs().amax(dim=2).clamp(min=MIN_ACTIVATION_AMAX) / E4M3_MAX
    quantized = (groups / scales.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(padded_rows, k)
    return quantized, scales.t().contiguous().t()


def _scaled_mm_blocks(
    quantized: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    scale_view: str,
) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with a scale per row and 128 columns on both sides (sm90, CUDA 12.9+).
    `scale_view`: how the weight's scales ([N, K / 128], N-major) are handed over (SCALE_VIEWS)."""
    recipe = F.ScalingType.BlockWise1x128
    scale_b = weight_scale if scale_view == "n-major" else weight_scale.t()
    return F.scaled_mm(quantized, weight.t(), scales, recipe, scale_b, recipe, output_dtype=out_dtype)


# The weight scales' layouts the probe tries, in order: [N, K / 128] as the weight's rows (the
# activations' scales go token-major), or as mat_b = weight.t() [K, N] has its dimensions.
SCALE_VIEWS = ("n-major", "k-rows")


@dataclass(frozen=True)
class BlockScaledMM:
    """How this device's block-scaled GEMM takes its operands (found by _probe_block_scaled_mm)."""

    scale_view: str  # one of SCALE_VIEWS
    group_multiple: int  # the groups of 128 columns a row has must be a multiple of this


_BLOCK_SCALED_MM: dict[tuple[str, int | None], BlockScaledMM | None] = {}


def block_scaled_mm_takes(device: torch.device, in_features: int) -> bool:
    """Whether `device` runs the block-scaled FP8 GEMM for weights `in_features` wide, giving the
    dequantized product (tried once per device on small cases whose scales differ by row and
    group: a misread layout shows); where it does not, such weights are dequantized at load."""
    found = _block_scaled_mm(device)
    return found is not None and in_features % (GROUP_COLUMNS * found.group_multiple) == 0


def _block_scaled_mm(device: torch.device) -> BlockScaledMM | None:
    key = (device.type, device.index)
    if key not in _BLOCK_SCALED_MM:
        _BLOCK_SCALED_MM[key] = _probe_block_scaled_mm(device)
    return _BLOCK_SCALED_MM[key]


def new_group_scales(
    num_rows: int, num_columns: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """An uninitialised float32 [num_rows, ceil(num_columns / 128)] for a block-scaled weight's
    scales, stored N-major (column-major), as cuBLASLt reads them."""
    num_groups = -(-num_columns // GROUP_COLUMNS)
    return torch.empty((num_groups, num_rows), dtype=torch.float32, device=device).t()


def _probe_block_scaled_mm(device: torch.device) -> BlockScaledMM | None:
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return None
    for scale_view in SCALE_VIEWS:
        if _block_scaled_mm_agrees(device, scale_view, num_groups=4):
            odd = _block_scaled_mm_agrees(device, scale_view, num_groups=3)
            return BlockScaledMM(scale_view, 1 if odd else 4)
    return None


def _block_scaled_mm_agrees(device: torch.device, scale_view: str, num_groups: int) -> bool:
    generator = torch.Generator(device=device).manual_seed(num_groups)
    num_rows, k, n = 5, num_groups * GROUP_COLUMNS, 256
    x = torch.randn(num_rows, k, device=device, generator=generator)
    x = (x * torch.linspace(0.1, 30.0, k, device=device)).to(torch.bfloat16)  # groups of unlike range
    weight = (torch.randn(n, k, device=device, generator=generator) * 100).clamp(-448, 448).to(E4M3)
    weight_scale = new_group_scales(n, k, device)
    weight_scale.copy_(torch.rand(n, num_groups, device=device, generator=generator) * 4 + 0.05)
    quantized, scales = quantize_groups(x, SCALED_MM_ROW_PAD)
    activations = quantized[:num_rows].to(torch.float32) * scales[:num_rows].repeat_interleave(
        GROUP_COLUMNS, dim=1
    )
    expected = activations @ group_dequantized_weight(weight, weight_scale, torch.float32).t()
    try:
        got = _scaled_mm_blocks(quantized, scales, weight, weight_scale, torch.bfloat16, scale_view)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return False
    error = (got[:num_rows].to(torch.float32) - expected).abs().max()
    return bool(error <= 2e-2 * expected.abs().max())


def block_scaled_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear over a block-scaled FP8 weight (`weight_scale` [N, ceil(K / 128)]): on CUDA where
    block_scaled_mm_takes, W8A8 with the activations quantized per token and 128 columns (the
    checkpoints' recipe), any row count (cuBLASLt pads to 4 rows); elsewhere the weight
    dequantized for the call."""
    n, k = weight.shape
    assert weight.dtype == E4M3 and weight_scale.shape == (n, -(-k // GROUP_COLUMNS))
    if not (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and n % SCALED_MM_ALIGN == 0
        and block_scaled_mm_takes(x.device, k)
    ):
        return F.linear(x, group_dequantized_weight(weight, weight_scale, x.dtype), bias)
    leading = x.shape[:-1]
    rows = x.reshape(-1, k)
    quantized, scales = quantize_groups(rows, SCALED_MM_ROW_PAD)
    found = _block_scaled_mm(x.device)
    assert found is not None
    out = _scaled_mm_blocks(quantized, scales, weight, weight_scale, x.dtype, found.scale_view)
    out = out[: rows.shape[0]]
    if bias is not None:
        out = out + bias
    return out.view(*leading, n)
