"""layers/cpu_linear.py: which shapes go through oneDNN, and that its result is F.linear's to
float32 rounding (at one row and at many, with and without a bias)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_llm.layers.cpu_linear import (
    MIN_IN_FEATURES,
    MIN_WEIGHT_ELEMENTS,
    onednn_linear,
    onednn_linear_available,
    onednn_linear_op_exists,
    uses_onednn,
)

needs_onednn = pytest.mark.skipif(not onednn_linear_op_exists(), reason="torch has no oneDNN linear here")


@needs_onednn
def test_the_probe_passes_where_the_op_exists():
    """A oneDNN that gives wrong sums would only turn the path off; here it fails instead."""
    assert onednn_linear_available()


@needs_onednn
def test_the_rule_takes_wide_float32_matrices_only():
    wide = torch.empty(MIN_WEIGHT_ELEMENTS // MIN_IN_FEATURES, MIN_IN_FEATURES)
    assert uses_onednn(torch.empty(1, MIN_IN_FEATURES), wide)
    assert uses_onednn(torch.empty(64, MIN_IN_FEATURES), wide)
    assert not uses_onednn(torch.empty(1, MIN_IN_FEATURES), wide[:-1])  # fewer weights
    narrow = torch.empty(MIN_WEIGHT_ELEMENTS, MIN_IN_FEATURES // 2)
    assert not uses_onednn(torch.empty(1, MIN_IN_FEATURES // 2), narrow)  # the tiny model's LM head kind
    assert not uses_onednn(torch.empty(1, MIN_IN_FEATURES, dtype=torch.bfloat16), wide.bfloat16())
    assert not uses_onednn(torch.empty(2, 1, MIN_IN_FEATURES), wide)  # 3-D: F.linear


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 3, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_is_f_linear_to_rounding(num_rows, with_bias):
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(2048, 512, generator=generator) * 0.05
    bias = torch.randn(4096, generator=generator)[::2] if with_bias else None  # strided too
    x = torch.randn(num_rows, 1024, generator=generator)[:, ::2]  # a strided input too
    assert uses_onednn(x, weight)
    with torch.inference_mode():
        out = onednn_linear(x, weight, bias)
        expected = F.linear(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_small_or_16_bit_inputs_fall_back_to_f_linear_exactly():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=generator)
    x = torch.randn(4, 64, generator=generator)
    assert torch.equal(onednn_linear(x, weight), F.linear(x, weight))
    x16, weight16 = x.bfloat16(), weight.bfloat16()
    assert torch.equal(onednn_linear(x16, weight16), F.linear(x16, weight16))
