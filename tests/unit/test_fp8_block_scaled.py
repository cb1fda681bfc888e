"""Block-scaled FP8 weights kept in FP8 (layers/fp8_linear.py block_scaled_linear): the scales a
weight (slice) keeps, a scale a row and 128 columns, give the values fp8.dequantize gives for the
same slice; the activations' groups quantize within FP8's rounding; off CUDA the layer is F.linear
over the dequantized weight, and nothing claims the block-scaled GEMM runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paged_llm.layers.fp8_format import E4M3, E4M3_MAX
from paged_llm.layers.fp8_linear import (
    GROUP_COLUMNS,
    block_scaled_linear,
    block_scaled_mm_takes,
    fp8_linear,
    fp8_weights_stay_fp8,
    group_dequantized_weight,
    new_group_scales,
    quantize_groups,
)
from paged_llm.models import fp8


def _block_weight(rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8-block weight with 128 x 128 blocks whose scales differ block by block."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, columns, generator=generator)
    values *= torch.rand(rows, 1, generator=generator) * 10 + 0.01  # rows of unlike range
    return fp8.quantize(values, fp8.KEPT_BLOCK_LAYOUT)


@pytest.mark.parametrize(
    ("shape", "rows", "columns"),
    [
        ((300, 520), None, None),  # partial blocks at both ends
        ((300, 520), (64, 200), None),  # a rank's rows, starting inside a block
        ((300, 520), None, (256, 520)),  # a rank's columns, starting on a block
        ((256, 384), (128, 256), (128, 384)),
    ],
)
def test_kept_group_scales_give_the_dequantized_slice(shape, rows, columns):
    weight, scale = _block_weight(*shape, seed=1)
    part = weight
    if rows is not None:
        part = part[rows[0] : rows[1]]
    if columns is not None:
        part = part[:, columns[0] : columns[1]]
    kept = fp8.group_scales(scale, fp8.KEPT_BLOCK_LAYOUT, rows, columns, tuple(part.shape))
    assert kept.shape == (part.shape[0], -(-part.shape[1] // GROUP_COLUMNS))
    expected = fp8.dequantize(part, scale, fp8.KEPT_BLOCK_LAYOUT, rows, columns)
    assert torch.equal(group_dequantized_weight(part, kept, torch.float32), expected)
    assert torch.equal(group_dequantized_weight(part, kept, torch.bfloat16), expected.to(torch.bfloat16))


def test_a_column_slice_inside_a_block_is_refused():
    _, scale = _block_weight(128, 256, seed=2)
    with pytest.raises(AssertionError, match="splits a block"):
        fp8.group_scales(scale, fp8.KEPT_BLOCK_LAYOUT, None, (64, 256), (128, 192))


def test_activation_groups_quantize_within_fp8_rounding_with_padded_rows():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3 * GROUP_COLUMNS, generator=generator)
    x *= torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(GROUP_COLUMNS)  # groups of unlike range
    quantized, scales = quantize_groups(x.to(torch.bfloat16), pad_rows_to=4)
    assert quantized.dtype == E4M3 and quantized.shape == (8, 3 * GROUP_COLUMNS)
    assert scales.shape == (8, 3) and scales.stride() == (1, 8)  # token-major, as cuBLASLt reads them
    assert not quantized[5:].to(torch.float32).any()
    back = quantized[:5].to(torch.float32) * scales[:5].repeat_interleave(GROUP_COLUMNS, dim=1)
    reference = x.to(torch.bfloat16).to(torch.float32)
    assert torch.allclose(back, reference, rtol=2**-3, atol=scales[:5].max().item() * 2**-9)
    largest = quantized[:5].to(torch.float32).abs().view(5, 3, GROUP_COLUMNS).amax(dim=2)
    assert torch.equal(largest, torch.full_like(largest, E4M3_MAX))  # each group's largest maps to 448


def test_the_group_quantization_kernel_gives_the_torch_ops_values():
    """The Triton kernel quantize_groups runs on CUDA: the torch ops' scales, zero padding rows and,
    on a card, values at most one e4m3 step apart (on a CPU machine it runs in Triton's
    interpreter, whose e4m3 casts are not the card's)."""
    from paged_llm.layers import fp8_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4 * GROUP_COLUMNS, generator=generator)
    x = (x * torch.tensor([1e-3, 1.0, 50.0, 0.0]).repeat_interleave(GROUP_COLUMNS)).to(torch.bfloat16)
    quantized = torch.empty((8, 4 * GROUP_COLUMNS), dtype=E4M3, device=device)
    scales = torch.empty((4, 8), device=device).t()
    fp8_linear._quantize_groups_kernel[(8, 4)](
        x.to(device), quantized, scales, 7, x.stride(0), quantized.stride(0), 8,
        fp8_linear.MIN_ACTIVATION_AMAX, E4M3_MAX, GROUP=GROUP_COLUMNS,
    )  # fmt: skip
    expected_quantized, expected_scales = quantize_groups(x, pad_rows_to=4)
    torch.testing.assert_close(scales.cpu(), expected_scales, rtol=1e-6, atol=0.0)
    assert not quantized[7:].float().any()
    if device == "cuda":  # the interpreter's e4m3 casts are not the card's (-126.15 -> -64.0)
        codes = quantized.cpu().view(torch.uint8).int()  # e4m3 codes: adjacent values, adjacent codes
        assert (codes - expected_quantized.view(torch.uint8).int()).abs().max() <= 1
        on_device, device_scales = quantize_groups(x.to(device), pad_rows_to=4)
        assert torch.equal(on_device, quantized) and torch.equal(device_scales, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_off_cuda_the_layer_is_the_dequantized_linear(dtype):
    weight, scale = _block_weight(192, 640, seed=4)
    kept = new_group_scales(192, 640)
    kept.copy_(fp8.group_scales(scale, fp8.KEPT_BLOCK_LAYOUT, None, None, (192, 640)))
    assert kept.stride() == (1, 192)  # N-major, as the layers hold them
    x = torch.randn(3, 7, 640).to(dtype)
    bias = torch.randn(192).to(dtype)
    expected = F.linear(x, fp8.dequantize(weight, scale, fp8.KEPT_BLOCK_LAYOUT).to(dtype), bias)
    assert torch.equal(block_scaled_linear(x, weight, kept, bias), expected)
    assert torch.equal(fp8_linear(x, weight, kept, bias), expected)  # a 2-D scale: block-scaled


def test_nothing_claims_the_block_scaled_gemm_off_cuda(monkeypatch):
    monkeypatch.delenv("PAGED_LLM_FP8_WEIGHTS", raising=False)
    cpu = torch.device("cpu")
    assert not block_scaled_mm_takes(cpu, 1024)
    assert not fp8_weights_stay_fp8(cpu, [1024, 3072])
    monkeypatch.setenv("PAGED_LLM_FP8_WEIGHTS", "keep")
    assert fp8_weights_stay_fp8(cpu, [1024, 3072])


def test_this_torch_has_the_block_scaled_gemms_interface():
    """The GEMM block_scaled_linear calls on CUDA (its probe tells whether the card and the
    cuBLASLt build run it): present in this torch."""
    assert hasattr(F, "scaled_mm") and hasattr(F.ScalingType, "BlockWise1x128")


_COMPILE = r"""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_llm.layers import fp8_linear

kernel = fp8_linear._quantize_groups_kernel
names = list(inspect.signature(kernel.fn).parameters)
kinds = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "min_amax": "fp32", "fp8_max": "fp32"}
signature = {name: "constexpr" if name == "GROUP" else kinds.get(name, "i32") for name in names}
source = ASTSource(kernel, signature, constexprs={(names.index("GROUP"),): 128})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert compiled.asm["cubin"]
print("compiled", len(compiled.asm["cubin"]), "bytes of cubin")
"""


def test_the_group_quantization_kernel_compiles_for_sm90(tmp_path):
    """What only the compiler rejects (the interpreter runs the kernel's Python semantics): compiled
    for Hopper with the Triton wheel's ptxas, in a subprocess without TRITON_INTERPRET."""
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("no ptxas in the triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bytes of cubin" in result.stdout
