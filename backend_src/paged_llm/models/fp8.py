"""FP8 (e4m3) weights: which published layout a checkpoint's config.json declares, and the
(de)quantization of each. Scales multiply: weight = fp8 value x its scale.

- "fp8-block": HF fine-grained FP8 (`quant_method: fp8`, Qwen3-*-FP8, DeepSeek): `X.weight_scale_inv`
  [ceil(out / bn), ceil(in / bk)] per (bn x bk) block of `weight_block_size`; activations quantized
  per token group at run time.
- "fp8-channel": compressed-tensors `float-quantized` with per-channel weights ("FP8-dynamic",
  RedHatAI / Neural Magic): `X.weight_scale` [out, 1]; activations per token at run time.
- "fp8-tensor": compressed-tensors per-tensor static: `X.weight_scale` [1] (older checkpoints: []) and a
  static `X.input_scale` [1].
- "online" (`quantization: fp8` on a bf16 checkpoint, as vLLM's `--quantization fp8`): quantized at
  load, per channel (vLLM's online mode is per tensor: per channel keeps more precision).

Only the decoder layers' projections (q/k/v/o, gate/up/down) are FP8 in these layouts; embeddings,
norms and lm_head stay in the model dtype. Scales come in float32, bfloat16 or float16 (Qwen3's
dense checkpoints store bfloat16); the product is taken in float32, where fp8 x bf16 is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from paged_llm.config import ConfigError
from paged_llm.layers.fp8_format import E4M3, E4M3_MAX

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Per-layer tensors an FP8 checkpoint may carry besides the weights' scales: static activation
# scales (unused while activations stay in the model dtype) and the KV cache's scales, in the names
# llm-compressor, ModelOpt and vLLM have used (newest first).
ACTIVATION_SCALE_SUFFIXES = ("input_scale", "activation_scale")
KV_SCALE_SUFFIXES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.kv_scale": "kv",  # one scale for both (deprecated)
}
LAYOUTS = ("fp8-block", "fp8-channel", "fp8-tensor")
# The layouts whose weights can stay FP8 with one scale per output row (layers/fp8_linear.py).
ROW_SCALED_LAYOUTS = ("fp8-channel", "fp8-tensor")
# fp8-block weights stay FP8 with these blocks (Qwen3-*-FP8's, DeepSeek's), a scale per row and
# 128 columns (layers/fp8_linear.py block_scaled_linear); other block sizes are dequantized at load.
KEPT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Layout:
    kind: str  # fp8-block | fp8-channel | fp8-tensor
    source: str  # hf-fp8 | compressed-tensors | online
    scale_suffix: str  # the scale tensor beside each weight: weight_scale_inv | weight_scale
    block: tuple[int, int] | None = None  # fp8-block: (rows, columns) a scale covers

    def describe(self) -> str:
        detail = f", blocks {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.kind} ({self.source}{detail})"

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a weight of `weight_shape` (fp8-tensor also takes [])."""
        rows, columns = weight_shape
        if self.kind == "fp8-block":
            assert self.block is not None
            return (math.ceil(rows / self.block[0]), math.ceil(columns / self.block[1]))
        if self.kind == "fp8-channel":
            return (rows, 1)
        return (1,)


ONLINE_LAYOUT = Fp8Layout("fp8-channel", "online", "weight_scale")
KEPT_BLOCK_LAYOUT = Fp8Layout("fp8-block", "hf-fp8", "weight_scale_inv", KEPT_BLOCK)


def detect_fp8_layout(config: dict[str, Any], quantization: str = "") -> Fp8Layout | None:
    """The FP8 layout config.json declares (`quantization_config`), or the online one when
    `quantization` is "fp8" on an unquantized checkpoint; None: not quantized. Raises ConfigError
    naming the field for what this engine does not load."""
    if quantization not in ("", "fp8"):
        raise ConfigError(
            f"quantization must be fp8 (or empty: what the checkpoint says), got {quantization!r}"
        )
    quant = config.get("quantization_config")
    if quant is None:
        return ONLINE_LAYOUT if quantization == "fp8" else None
    if not isinstance(quant, dict):
        raise ConfigError(f"config.json quantization_config must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _hf_fp8_layout(quant)
    if method == "compressed-tensors":
        return _compressed_tensors_layout(quant)
    raise ConfigError(
        f"config.json quantization_config.quant_method {method!r} is not supported "
        "(supported: fp8 with weight_block_size, compressed-tensors float-quantized FP8)"
    )


def _hf_fp8_layout(quant: dict[str, Any]) -> Fp8Layout:
    field = "config.json quantization_config"
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{field}.fmt {fmt!r} is not supported (supported: e4m3)")
    block = quant.get("weight_block_size")
    if block is None:
        raise ConfigError(
            f"{field}.weight_block_size is missing: per-tensor quant_method fp8 checkpoints (AutoFP8) "
            "are not supported (supported: fine-grained blocks, or compressed-tensors)"
        )
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(size, int) and size > 0 for size in block)
    ):
        raise ConfigError(f"{field}.weight_block_size must be two positive integers, got {block!r}")
    activation = quant.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise ConfigError(f"{field}.activation_scheme {activation!r} is not supported with blocks (dynamic)")
    scale_fmt = quant.get("scale_fmt", "float")
    if scale_fmt not in (None, "float"):
        raise ConfigError(f"{field}.scale_fmt {scale_fmt!r} is not supported (supported: float)")
    return Fp8Layout("fp8-block", "hf-fp8", "weight_scale_inv", (block[0], block[1]))


def _compressed_tensors_layout(quant: dict[str, Any]) -> Fp8Layout:
    field = "config.json quantization_config"
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{field}.config_groups is missing or empty")
    for key in ("sparsity_config", "transform_config"):
        if quant.get(key):
            raise ConfigError(f"{field}.{key} is not supported")
    strategies = set()
    for name, group in groups.items():
        where = f"{field}.config_groups.{name}"
        fmt = group.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ConfigError(f"{where}.format {fmt!r} is not supported (supported: float-quantized)")
        weights = group.get("weights") or {}
        expected = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        for key, value in expected.items():
            if weights.get(key, value) != value:
                raise ConfigError(f"{where}.weights.{key} is {weights.get(key)!r}; FP8 needs {value!r}")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise ConfigError(
                f"{where}.weights.strategy {strategy!r} is not supported (supported: channel, tensor)"
            )
        strategies.add(strategy)
        for target in group.get("targets", ["Linear"]):
            if target != "Linear" and not str(target).startswith("re:"):
                raise ConfigError(f"{where}.targets {target!r} is not supported (supported: Linear, re:...)")
    if len(strategies) > 1:
        raise ConfigError(
            f"{field}.config_groups mix weight strategies {sorted(strategies)}; one is supported"
        )
    kind = "fp8-channel" if strategies == {"channel"} else "fp8-tensor"
    return Fp8Layout(kind, "compressed-tensors", "weight_scale")


def kv_scale_target(layer_name: str) -> str | None:
    """Which cache a per-layer tensor (its name inside model.layers.N) scales: "k", "v", "kv"
    (both), or None when it is no KV cache scale."""
    return KV_SCALE_SUFFIXES.get(layer_name)


def is_projection_weight(layer_name: str) -> bool:
    """`layer_name` (a tensor's name inside model.layers.N) is one of the seven FP8 projections' weights."""
    return layer_name.endswith(".weight") and layer_name[: -len(".weight")] in PROJECTIONS


def check_scale(layout: Fp8Layout, hf_name: str, weight_shape: tuple[int, ...], scale: torch.Tensor) -> None:
    """Refuses a scale tensor whose shape is not the layout's for this weight (a block size other
    than weight_block_size, a per-tensor scale in a per-channel checkpoint, ...), naming it."""
    expected = layout.scale_shape(weight_shape)
    got = tuple(scale.shape)
    if got == expected or (layout.kind == "fp8-tensor" and got == ()):
        return
    detail = f" (blocks of {layout.block[0]}x{layout.block[1]})" if layout.block else ""
    raise ConfigError(
        f"checkpoint tensor {hf_name} has shape {got}; {layout.kind}{detail} needs {expected} "
        f"for a weight of shape {tuple(weight_shape)}"
    )


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    layout: Fp8Layout,
    rows: tuple[int, int] | None = None,
    columns: tuple[int, int] | None = None,
) -> torch.Tensor:
    """float32 values of `weight` (fp8): each times its scale. `weight` may be a slice of the full
    tensor, rows [rows) and columns [columns) of it (tensor parallelism); `scale` is the full
    tensor's, indexed by global position, so a slice need not start on a block."""
    num_rows, num_columns = weight.shape
    row_start = rows[0] if rows is not None else 0
    column_start = columns[0] if columns is not None else 0
    values = weight.to(torch.float32)
    scale = scale.to(device=values.device, dtype=torch.float32)
    if layout.kind == "fp8-block":
        assert layout.block is not None
        row_blocks = torch.arange(row_start, row_start + num_rows, device=values.device) // layout.block[0]
        column_blocks = (
            torch.arange(column_start, column_start + num_columns, device=values.device) // layout.block[1]
        )
        return values * scale[row_blocks][:, column_blocks]
    if layout.kind == "fp8-channel":
        return values * scale.reshape(-1, 1)[row_start : row_start + num_rows]
    return values * scale.reshape(())


def row_scales(
    scale: torch.Tensor, layout: Fp8Layout, rows: tuple[int, int] | None, num_rows: int
) -> torch.Tensor:
    """float32 [num_rows]: the scale of each row of a weight (or of rows [rows) of it) in a layout
    with one scale a row (fp8-channel) or one for all (fp8-tensor): an FP8 weight kept in FP8."""
    assert layout.kind in ROW_SCALED_LAYOUTS, f"{layout.kind} has no scale a row"
    values = scale.to(torch.float32)
    if layout.kind == "fp8-tensor":
        return values.reshape(()).expand(num_rows).contiguous()
    start = rows[0] if rows is not None else 0
    return values.reshape(-1)[start : start + num_rows].contiguous()


def keeps_blocks(layout: Fp8Layout | None) -> bool:
    """A block-scaled layout whose weights can stay FP8 (KEPT_BLOCK)."""
    return layout is not None and layout.kind == "fp8-block" and layout.block == KEPT_BLOCK


def group_scales(
    scale: torch.Tensor,
    layout: Fp8Layout,
    rows: tuple[int, int] | None,
    columns: tuple[int, int] | None,
    shape: tuple[int, int],
) -> torch.Tensor:
    """float32 [rows, ceil(columns / 128)]: the scale of each row and 128 columns of a block-scaled
    weight of `shape` (rows [rows) and columns [columns) of the full one: tensor parallelism), its
    block's scale repeated for the block's rows. A column slice must start on a block."""
    assert keeps_blocks(layout) and layout.block is not None
    block_rows, block_columns = layout.block
    num_rows, num_columns = shape
    row_start = rows[0] if rows is not None else 0
    column_start = columns[0] if columns is not None else 0
    assert column_start % block_columns == 0, f"a column slice from {column_start} splits a block"
    first_group = column_start // block_columns
    groups = torch.arange(first_group, first_group + math.ceil(num_columns / block_columns))
    row_blocks = torch.arange(row_start, row_start + num_rows) // block_rows
    return scale.to(torch.float32)[row_blocks][:, groups].contiguous()


def quantize(
    weight: torch.Tensor, layout: Fp8Layout, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale) in `layout`: each scale is its group's largest magnitude / 448 (1 for an
    all-zero group), rounded to `scale_dtype`; the values divided by it are clamped to +-448 before
    the cast (a cast need not saturate)."""
    values = weight.to(torch.float32)
    num_rows, num_columns = values.shape
    if layout.kind == "fp8-block":
        assert layout.block is not None
        block_rows, block_columns = layout.block
        grid_rows, grid_columns = math.ceil(num_rows / block_rows), math.ceil(num_columns / block_columns)
        padded = values.new_zeros(grid_rows * block_rows, grid_columns * block_columns)
        padded[:num_rows, :num_columns] = values.abs()
        amax = padded.view(grid_rows, block_rows, grid_columns, block_columns).amax(dim=(1, 3))
    elif layout.kind == "fp8-channel":
        amax = values.abs().amax(dim=1, keepdim=True)
    else:
        amax = values.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    expanded = dequantize(torch.ones_like(values), scale, layout)
    quantized = (values / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return quantized, scale
