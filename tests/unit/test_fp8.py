"""FP8 layouts (models/fp8.py): what each published config.json declares, the refusals, and the
weights' (de)quantization against HF transformers' own fine-grained FP8 dequantization."""

from __future__ import annotations

import pytest
import torch

from paged_llm.config import ConfigError
from paged_llm.layers.fp8_format import E4M3, E4M3_MAX
from paged_llm.models import fp8
from paged_llm.models.random_model import fp8_quantization_config

BLOCK = fp8.Fp8Layout("fp8-block", "hf-fp8", "weight_scale_inv", (128, 128))


@pytest.mark.parametrize("layout", fp8.LAYOUTS)
def test_each_written_config_is_detected_as_its_layout(layout):
    detected = fp8.detect_fp8_layout({"quantization_config": fp8_quantization_config(layout)})
    assert detected is not None and detected.kind == layout
    assert detected.scale_suffix == ("weight_scale_inv" if layout == "fp8-block" else "weight_scale")


def test_qwen3_fp8_config_and_the_online_mode():
    qwen = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert fp8.detect_fp8_layout({"quantization_config": qwen}) == BLOCK
    assert fp8.detect_fp8_layout({"quantization_config": qwen}, "fp8") == BLOCK  # the checkpoint's own
    assert fp8.detect_fp8_layout({}) is None
    assert fp8.detect_fp8_layout({}, "fp8") == fp8.ONLINE_LAYOUT


def _ct(**weights) -> dict:
    config = fp8_quantization_config("fp8-channel")
    config["config_groups"]["group_0"]["weights"] |= weights
    return config


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"quant_method": "fp8"}, "weight_block_size is missing"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size must be two"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "activation_scheme 'static'",
        ),
        ({"quant_method": "compressed-tensors"}, "config_groups is missing"),
        (_ct(num_bits=4), "weights.num_bits is 4"),
        (_ct(type="int"), "weights.type is 'int'"),
        (_ct(strategy="group"), "weights.strategy 'group'"),
        (_ct(dynamic=True), "weights.dynamic is True"),
        (fp8_quantization_config("fp8-channel") | {"format": "pack-quantized"}, None),
    ],
)
def test_layouts_it_does_not_load_are_refused_naming_the_field(quant, field):
    if field is None:  # the group's own format wins over the top level's
        assert fp8.detect_fp8_layout({"quantization_config": quant}).kind == "fp8-channel"
        return
    with pytest.raises(ConfigError, match="quantization_config") as error:
        fp8.detect_fp8_layout({"quantization_config": quant})
    assert field in str(error.value)


def test_a_quantization_other_than_fp8_is_refused():
    with pytest.raises(ConfigError, match="quantization must be fp8"):
        fp8.detect_fp8_layout({}, "int4")


@pytest.mark.parametrize("shape", [(256, 128), (300, 200), (130, 129), (64, 32)])
def test_block_dequantization_equals_transformers(shape):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    quantized, scale = fp8.quantize(weight, BLOCK, torch.bfloat16)
    assert quantized.dtype == E4M3 and scale.dtype == torch.bfloat16
    assert tuple(scale.shape) == ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
    ours = fp8.dequantize(quantized, scale, BLOCK)
    theirs = _dequantize_fp8_weight(quantized, scale.float(), [128, 128], torch.float32)
    assert torch.equal(ours, theirs)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (plus the subnormal floor)
    assert torch.all((ours - weight).abs() <= weight.abs() / 16 + scale.float().max() * 2**-9)


@pytest.mark.parametrize("kind", ["fp8-channel", "fp8-tensor"])
def test_channel_and_tensor_scales(kind):
    layout = fp8.Fp8Layout(kind, "compressed-tensors", "weight_scale")
    weight = torch.randn(96, 40, generator=torch.Generator().manual_seed(1))
    weight[5] = 0.0  # an all-zero channel keeps scale 1
    quantized, scale = fp8.quantize(weight, layout)
    assert tuple(scale.shape) == ((96, 1) if kind == "fp8-channel" else (1,))
    expected = quantized.float() * (scale if kind == "fp8-channel" else scale.reshape(()))
    assert torch.equal(fp8.dequantize(quantized, scale, layout), expected)
    if kind == "fp8-channel":
        assert scale[5].item() == 1.0
        assert torch.equal(
            scale[:, 0], torch.where(weight.abs().amax(1) > 0, weight.abs().amax(1) / 448, 1.0)
        )
    assert quantized.float().abs().max().item() == E4M3_MAX  # the largest value maps to 448


@pytest.mark.parametrize(
    ("layout", "rows", "columns"),
    [
        (fp8.Fp8Layout("fp8-block", "hf-fp8", "weight_scale_inv", (48, 80)), (40, 100), None),
        (fp8.Fp8Layout("fp8-block", "hf-fp8", "weight_scale_inv", (48, 80)), None, (70, 130)),
        (fp8.Fp8Layout("fp8-channel", "compressed-tensors", "weight_scale"), (13, 77), None),
        (fp8.Fp8Layout("fp8-tensor", "compressed-tensors", "weight_scale"), None, (3, 9)),
    ],
)
def test_a_slice_dequantizes_as_that_part_of_the_whole(layout, rows, columns):
    """Tensor parallelism: a rank's rows or columns, which need not start on a block, with the
    full tensor's scale."""
    weight = torch.randn(150, 160, generator=torch.Generator().manual_seed(2))
    quantized, scale = fp8.quantize(weight, layout)
    whole = fp8.dequantize(quantized, scale, layout)
    if rows is not None:
        part = fp8.dequantize(quantized[rows[0] : rows[1]], scale, layout, rows=rows)
        assert torch.equal(part, whole[rows[0] : rows[1]])
    else:
        part = fp8.dequantize(quantized[:, columns[0] : columns[1]], scale, layout, columns=columns)
        assert torch.equal(part, whole[:, columns[0] : columns[1]])


def test_a_scale_of_the_wrong_shape_is_refused_naming_it():
    fp8.check_scale(BLOCK, "x.weight_scale_inv", (300, 200), torch.ones(3, 2))
    with pytest.raises(
        ConfigError, match=r"x.weight_scale_inv has shape \(5, 4\); fp8-block \(blocks of 128x128\)"
    ):
        fp8.check_scale(BLOCK, "x.weight_scale_inv", (300, 200), torch.ones(5, 4))
    tensor = fp8.Fp8Layout("fp8-tensor", "compressed-tensors", "weight_scale")
    fp8.check_scale(tensor, "y.weight_scale", (8, 8), torch.ones(()))  # older checkpoints: a scalar
    with pytest.raises(ConfigError, match=r"y.weight_scale has shape \(8, 1\); fp8-tensor needs \(1,\)"):
        fp8.check_scale(tensor, "y.weight_scale", (8, 8), torch.ones(8, 1))
