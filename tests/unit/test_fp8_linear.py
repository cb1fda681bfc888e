"""Linear layers over FP8 weights kept in FP8 (layers/fp8_linear.py, the FP8 GEMVs of
layers/triton_gemv.py) against the same weights dequantized: the one-row GEMVs (plain, with the
RMSNorm before it, with SiLU * up before it) through Triton's interpreter on CPU, compiled on a GPU;
the W8A8 GEMM (CUDA) within the error of quantizing the activations per token; the dequantizing
path elsewhere exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_llm.layers import triton_gemv
from paged_llm.layers.fp8_format import E4M3, E4M3_MAX
from paged_llm.layers.fp8_linear import dequantized_weight, fp8_linear, quantize_rows
from paged_llm.layers.torch_ops import rms_norm_torch, silu_and_mul_torch
from paged_llm.models import fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter has no bfloat16 arithmetic; bf16 runs where the kernels really compile.
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [n, k], float32 row scales [n]) of a random weight quantized a row at a time."""
    weight, scale = fp8.quantize(randn(n, k, seed=seed, scale=k**-0.5), fp8.ONLINE_LAYOUT)
    return weight.to(DEVICE), scale.view(-1).to(DEVICE)


def launches(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    kernel = getattr(triton_gemv, name)

    class Recorder:
        def __getitem__(self, grid):
            calls.append(1)
            return kernel[grid]

    monkeypatch.setattr(triton_gemv, name, Recorder())
    return calls


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # One rounding of the output apart (the GEMV scales its float32 sum; the reference rounds the
    # dequantized weight to the model dtype first, then sums in float32).
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("n", "k"), [(96, 512), (40, 1024)])
def test_one_row_fp8_gemv_is_the_dequantized_linear(n, k, monkeypatch):
    weight, scale = fp8_weight(n, k, seed=1)
    x = randn(1, k, seed=2).to(DEVICE, DTYPE)
    calls = launches(monkeypatch, "_gemv_kernel")
    actual = triton_gemv.linear_triton(x, weight, weight_scale=scale)
    assert calls, "the FP8 GEMV was not used"
    expected = x.float() @ dequantized_weight(weight, scale, torch.float32).T
    close(actual, expected)


@pytest.mark.parametrize("with_residual", [True, False])
def test_one_row_fp8_norm_gemv_is_norm_then_the_dequantized_linear(with_residual, monkeypatch):
    n, k = 64, 256
    weight, scale = fp8_weight(n, k, seed=3)
    x, residual = randn(1, k, seed=4).to(DEVICE, DTYPE), randn(1, k, seed=5).to(DEVICE, DTYPE)
    norm_weight = (1 + 0.1 * randn(k, seed=6)).to(DEVICE, DTYPE)
    res = residual if with_residual else None
    calls = launches(monkeypatch, "_norm_gemv_kernel")
    out, new_residual = triton_gemv.norm_linear_triton(x, res, norm_weight, 1e-6, weight, weight_scale=scale)
    assert calls, "the FP8 norm GEMV was not used"
    normed, want_residual = rms_norm_torch(
        x.float(), norm_weight.float(), 1e-6, None if res is None else res.float()
    )
    close(new_residual, want_residual)
    close(out, normed @ dequantized_weight(weight, scale, torch.float32).T)


def test_one_row_fp8_silu_mul_gemv_is_the_activation_then_the_dequantized_linear(monkeypatch):
    n, k = 64, 512
    weight, scale = fp8_weight(n, k, seed=7)
    gate_up = randn(1, 2 * k, seed=8).to(DEVICE, DTYPE)
    calls = launches(monkeypatch, "_silu_mul_gemv_kernel")
    actual = triton_gemv.silu_mul_linear_triton(gate_up, weight, weight_scale=scale)
    assert calls, "the FP8 SiLU-mul GEMV was not used"
    expected = silu_and_mul_torch(gate_up.float()) @ dequantized_weight(weight, scale, torch.float32).T
    close(actual, expected)


@pytest.mark.parametrize("rows", [2, 7, 33])
def test_more_rows_take_the_fp8_gemm(rows):
    """CUDA: W8A8 (activations quantized per token) within the activations' rounding of the
    dequantized linear; elsewhere the dequantized linear itself, bit for bit."""
    n, k = 128, 256
    weight, scale = fp8_weight(n, k, seed=9)
    x = randn(rows, k, seed=10).to(DEVICE, DTYPE)
    bias = randn(n, seed=11).to(DEVICE, DTYPE)
    actual = triton_gemv.linear_triton(x, weight, bias, weight_scale=scale)
    reference = torch.nn.functional.linear(x, dequantized_weight(weight, scale, DTYPE), bias)
    assert actual.shape == (rows, n) and actual.dtype == DTYPE
    if DEVICE == "cuda":
        # e4m3 keeps 3 bits of mantissa: each activation within 1/16 relative; summed over k
        # random terms the output moves by ~1/16/sqrt(3) of its scale
        torch.testing.assert_close(actual.float(), reference.float(), atol=0.1, rtol=0.1)
    else:
        assert torch.equal(actual, reference)
        assert torch.equal(fp8_linear(x, weight, scale, bias), reference)


def test_activations_quantize_a_row_at_a_time():
    """quantize_rows: each row's largest magnitude maps to +-448; values come back within e4m3's
    relative step; an all-zero row gives zeros (and a finite scale)."""
    x = (
        randn(5, 300, seed=12).to(DEVICE, DTYPE)
        * torch.tensor([1, 10, 1e-3, 0, 100.0]).to(DEVICE, DTYPE)[:, None]
    )
    quantized, scales = quantize_rows(x)
    assert quantized.dtype == E4M3 and scales.shape == (5, 1) and torch.isfinite(scales).all()
    back = quantized.float() * scales
    torch.testing.assert_close(back, x.float(), atol=1e-6, rtol=1 / 16)
    amax = quantized.float().abs().amax(dim=1)
    assert torch.equal(amax[[0, 1, 2, 4]], torch.full((4,), E4M3_MAX, device=DEVICE))
    assert torch.equal(quantized[3].float(), torch.zeros(300, device=DEVICE))
    if DEVICE == "cuda":  # the Triton kernel against the torch ops
        expected_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / E4M3_MAX
        torch.testing.assert_close(scales, expected_scales)


def test_row_scales_of_a_rank_slice():
    """A tensor-parallel rank's rows take their own scales (fp8-channel), or the one (fp8-tensor)."""
    channel = torch.arange(8, dtype=torch.bfloat16).view(8, 1)
    layout = fp8.Fp8Layout("fp8-channel", "compressed-tensors", "weight_scale")
    assert fp8.row_scales(channel, layout, (2, 5), 3).tolist() == [2.0, 3.0, 4.0]
    assert fp8.row_scales(channel, layout, None, 8).dtype == torch.float32
    tensor_layout = fp8.Fp8Layout("fp8-tensor", "compressed-tensors", "weight_scale")
    assert fp8.row_scales(torch.tensor([0.5]), tensor_layout, (4, 6), 2).tolist() == [0.5, 0.5]
