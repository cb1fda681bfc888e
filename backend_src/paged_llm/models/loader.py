"""Loads HF safetensors checkpoints (single file or sharded with an index) into a CausalLM.

Under tensor parallelism each rank reads only its own slice of every split tensor (safetensors'
`get_slice` reads those bytes alone), straight into its device: no rank holds a full copy of the
model in host memory.

FP8 checkpoints (models/fp8.py: the layouts config.json's quantization_config declares) and
`quantization` fp8 on an unquantized one: where the FP8 kernels run (CUDA, sm90) projections of a
layout with a scale a row (fp8-channel, fp8-tensor, online) stay FP8 with their row scales
(layers/fp8_linear.py); otherwise (CPU, NPU, fp8-block) each FP8 projection is dequantized at load
into the model dtype with its scale tensor (a rank's slice with the full scale, indexed by position)."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from paged_llm.config import ConfigError
from paged_llm.layers.fp8_format import E4M3
from paged_llm.layers.fp8_linear import fp8_weights_stay_fp8
from paged_llm.layers.fused_ops import FusedOps
from paged_llm.layers.parallel import ShardPlan, TensorParallelGroup
from paged_llm.models import fp8
from paged_llm.models.decoder import AttentionBackend, CausalLM, keep_fp8_projections, projections
from paged_llm.models.hf_config import ModelSpec

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our parameter, slice index within a fused parameter or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {model_dir}")
    return files


# Which dimension of an HF tensor splits under tensor parallelism, and by what (ShardPlan.rows_of).
# Column-parallel tensors split their rows (dim 0, biases too), row-parallel ones their columns.
_SPLIT_ROWS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "mlp.gate_proj": "intermediate",
    "mlp.up_proj": "intermediate",
}
_SPLIT_COLUMNS = {"self_attn.o_proj": "q", "mlp.down_proj": "intermediate"}


def _split_of(hf_name: str) -> tuple[int, str] | None:
    """(dimension, ShardPlan part) of a tensor that splits over ranks; None: replicated."""
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, "vocab"
    match = _LAYER_RE.match(hf_name)
    if match is None:
        return None
    module = match.group(2).rpartition(".")[0]
    if module in _SPLIT_ROWS:
        return 0, _SPLIT_ROWS[module]
    if module in _SPLIT_COLUMNS:
        return 1, _SPLIT_COLUMNS[module]
    return None


def _iter_tensors(
    files: list[Path],
    show_progress: bool,
    spec: ModelSpec,
    shard: ShardPlan,
    layout: fp8.Fp8Layout | None,
    keep_fp8: bool,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, tensor, row scales) for every checkpoint tensor, or this rank's slice of it. FP8
    projections come dequantized (float32, row scales None), or with `keep_fp8` as FP8 with their
    float32 row scales; their scale tensors and the other quantization tensors (activation and KV
    cache scales) are taken."""
    from safetensors import safe_open

    handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    by_name = {name: handle for handle in handles for name in handle.keys()}
    scales = _weight_scale_tensors(by_name, layout)
    names = [name for name in by_name if name not in scales]
    for name in tqdm(names, desc="Loading weights", unit="tensor", disable=not show_progress):
        handle = by_name[name]
        if _kv_scale_target(name) is not None:  # replicated, whatever its module splits
            yield name, handle.get_tensor(name), None
            continue
        split = _split_of(name) if shard.world_size > 1 else None
        if split is None:
            tensor, rows, columns = handle.get_tensor(name), None, None
        else:
            dim, part = split
            start, end = shard.rows_of(part, spec)
            view = handle.get_slice(name)
            rows, columns = ((start, end), None) if dim == 0 else (None, (start, end))
            tensor = view[start:end] if dim == 0 else view[:, start:end]
        row_scales = None
        if tensor.dtype == E4M3:
            scale = _checked_scale(name, handle, by_name, layout)
            assert layout is not None
            if keep_fp8:
                row_scales = _kept_scales(scale, layout, rows, columns, tensor)
            else:
                tensor = fp8.dequantize(tensor, scale, layout, rows, columns)
        elif layout is not None and f"{name.removesuffix('.weight')}.{layout.scale_suffix}" in scales:
            raise ConfigError(
                f"checkpoint tensor {name} is {tensor.dtype}, but it has a scale "
                f"({name.removesuffix('.weight')}.{layout.scale_suffix}) as FP8 weights have"
            )
        elif layout is not None and _is_projection(name) and (layout.source == "online" or keep_fp8):
            # quantization fp8; or a projection an FP8 checkpoint left unquantized, where every
            # projection is kept FP8: per channel, as online
            full = handle.get_tensor(name) if split is not None else tensor
            quantized_as = layout if keep_fp8 and fp8.keeps_blocks(layout) else fp8.ONLINE_LAYOUT
            weight, scale = fp8.quantize(full, quantized_as)
            if keep_fp8:
                tensor = _take(weight, rows, columns)
                row_scales = _kept_scales(scale, quantized_as, rows, columns, tensor)
            else:
                dequantized = fp8.dequantize(weight, scale, fp8.ONLINE_LAYOUT)
                tensor = dequantized if split is None else _take(dequantized, rows, columns)
        yield name, tensor, row_scales


def _kept_scales(
    scale: torch.Tensor,
    layout: fp8.Fp8Layout,
    rows: tuple[int, int] | None,
    columns: tuple[int, int] | None,
    tensor: torch.Tensor,
) -> torch.Tensor:
    """The scales an FP8 weight (slice) kept in FP8 holds: one a row, or one a row and 128 columns."""
    if fp8.keeps_blocks(layout):
        return fp8.group_scales(scale, layout, rows, columns, (tensor.shape[0], tensor.shape[1]))
    return fp8.row_scales(scale, layout, rows, tensor.shape[0])


def _splits_keep_blocks(model: CausalLM) -> bool:
    """Each rank's columns of o_proj and down_proj (split by tensor parallelism) start on a block,
    as a weight kept block-scaled needs (else its FP8 weights are dequantized at load)."""
    shard = model.shard
    if shard.world_size == 1:
        return True
    block_columns = fp8.KEPT_BLOCK[1]  # every rank's share alike: each rank decides the same
    q_columns = shard.num_heads * model.spec.head_dim
    return q_columns % block_columns == 0 and shard.intermediate_size % block_columns == 0


def _is_projection(hf_name: str) -> bool:
    match = _LAYER_RE.match(hf_name)
    return match is not None and fp8.is_projection_weight(match.group(2))


def _take(
    tensor: torch.Tensor, rows: tuple[int, int] | None, columns: tuple[int, int] | None
) -> torch.Tensor:
    if rows is not None:
        return tensor[rows[0] : rows[1]]
    return tensor[:, columns[0] : columns[1]] if columns is not None else tensor


def _kv_scale_target(hf_name: str) -> str | None:
    match = _LAYER_RE.match(hf_name)
    return fp8.kv_scale_target(match.group(2)) if match is not None else None


def _weight_scale_tensors(by_name: dict[str, object], layout: fp8.Fp8Layout | None) -> set[str]:
    """The checkpoint's weight scale tensors, read with their weights, and its static activation
    scales, not read (activations stay in the model dtype). A weight scale whose weight is missing
    is refused here; one beside an unquantized weight, when that weight is read."""
    if layout is None:
        return set()
    names = set()
    for name in by_name:
        module, _, leaf = name.rpartition(".")
        if leaf == layout.scale_suffix:
            if f"{module}.weight" not in by_name:
                raise ConfigError(f"checkpoint tensor {name} scales {module}.weight, which is missing")
            names.add(name)
        elif leaf in fp8.ACTIVATION_SCALE_SUFFIXES:
            names.add(name)
    return names


def _checked_scale(
    name: str, handle: object, by_name: dict[str, object], layout: fp8.Fp8Layout | None
) -> torch.Tensor:
    """The scale tensor of FP8 weight `name`, refusing what does not fit."""
    if layout is None or layout.source == "online":  # quantization fp8 quantizes unquantized weights
        raise ConfigError(
            f"checkpoint tensor {name} is {E4M3}, but config.json has no quantization_config "
            "saying how it is scaled"
        )
    if not _is_projection(name):
        raise ConfigError(
            f"checkpoint tensor {name} is {E4M3}: only the decoder layers' projections "
            f"({', '.join(fp8.PROJECTIONS)}) may be FP8"
        )
    module = name[: -len(".weight")]
    scale_name = f"{module}.{layout.scale_suffix}"
    if scale_name not in by_name:
        raise ConfigError(f"checkpoint tensor {name} is FP8, but its scale {scale_name} is missing")
    full_shape = tuple(handle.get_slice(name).get_shape())  # type: ignore[attr-defined]
    scale = by_name[scale_name].get_tensor(scale_name)  # type: ignore[attr-defined]
    fp8.check_scale(layout, scale_name, full_shape, scale)
    return scale


def _fused_slice(shard: ShardPlan, spec: ModelSpec, fused_name: str, part: int) -> tuple[int, int]:
    if fused_name == "self_attn.qkv_proj":
        q_size = shard.num_heads * spec.head_dim
        kv_size = shard.num_kv_heads * spec.head_dim
        bounds = [0, q_size, q_size + kv_size, q_size + 2 * kv_size]
    else:
        bounds = [0, shard.intermediate_size, 2 * shard.intermediate_size]
    return bounds[part], bounds[part + 1]


def load_model(
    model_dir: Path,
    spec: ModelSpec,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    show_progress: bool = True,
    ops: FusedOps | None = None,
    parallel: TensorParallelGroup | None = None,
    load_format: str = "safetensors",
    quantization: str = "",
    fp8_kv_cache: bool = False,
    keep_fp8_weights: bool | None = None,
) -> CausalLM:
    """Builds the model (this rank's share of it) on `device` without initialising weights, then
    copies every tensor in (load_format "dummy": draws random ones on the device instead).
    `quantization`: "" (the checkpoint's own) or "fp8" (models/fp8.py). `fp8_kv_cache`: the layers
    take the checkpoint's KV cache scales (k_scale / v_scale; ignored for a cache in the model
    dtype, as vLLM does), 1.0 where it has none. `keep_fp8_weights`: an FP8 layout's projections
    stay FP8 (layers/fp8_linear.py); None: where the FP8 kernels run (fp8_weights_stay_fp8), else
    they are dequantized into `dtype`."""
    layout = fp8.detect_fp8_layout(_read_config(Path(model_dir)), quantization)
    with torch.device("meta"):
        model = CausalLM(spec, backend, max_positions, ops, parallel)
    keep_blocks = fp8.keeps_blocks(layout) and _splits_keep_blocks(model)
    keep_fp8 = layout is not None and (layout.kind in fp8.ROW_SCALED_LAYOUTS or keep_blocks)
    if keep_fp8 and keep_fp8_weights is None:
        in_features = {linear.in_features for _, linear in projections(model)} if keep_blocks else None
        keep_fp8 = fp8_weights_stay_fp8(device, in_features)
    elif keep_fp8:
        keep_fp8 = keep_fp8_weights
    model = model.to(dtype)  # dtype first: no fp32 copy on the device
    if keep_fp8:
        keep_fp8_projections(model, block_scaled=keep_blocks)
    model = model.to_empty(device=device)
    shard = model.shard
    if layout is not None and shard.rank == 0:
        what = "FP8 checkpoint" if layout.source != "online" else "quantization fp8 (per channel, at load)"
        if keep_fp8 and keep_blocks:
            action = "projections kept in FP8 with a scale a row and 128 columns (block-scaled W8A8 GEMMs)"
        elif keep_fp8:
            action = "projections kept in FP8 with a scale a row (FP8 GEMV at one row, W8A8 GEMMs above)"
        else:
            action = f"dequantized at load to {dtype}"
        if load_format == "dummy":
            action = f"random weights; {action}"
        logger.info("%s: %s; %s on %s", what, layout.describe(), action, device)
    if load_format == "dummy":
        _fill_random(model, seed=shard.rank)
        model.rotary.build(device, dtype)
        return model.eval()
    if shard.world_size > 1:  # the last rank's vocabulary rows past vocab_size stay zero
        model.embed_tokens.weight.data.zero_()
        if model.lm_head is not None:
            model.lm_head.weight.data.zero_()
    params = dict(model.named_parameters())
    row_scale_buffers = {
        f"{name}.weight": linear.weight_scale for name, linear in projections(model) if keep_fp8
    }
    loaded: set[str] = set()
    with torch.no_grad():
        files = checkpoint_files(Path(model_dir))
        kv_scaled: dict[str, set[int]] = {"k": set(), "v": set()}  # layers given a scale
        for hf_name, tensor, row_scales in _iter_tensors(files, show_progress, spec, shard, layout, keep_fp8):
            kv_target = _kv_scale_target(hf_name)
            if kv_target is not None:
                if fp8_kv_cache:
                    layer = _set_kv_scale(model, hf_name, kv_target, tensor)
                    for cache in kv_target:
                        kv_scaled[cache].add(layer)
                continue
            target_name, rows = _map_name(spec, shard, hf_name)
            if target_name is None:
                continue
            if target_name not in params:
                raise ConfigError(f"checkpoint tensor {hf_name} has no place in {spec.architecture}")
            target = params[target_name]
            if rows is not None:
                target = target[rows[0] : rows[1]]
            elif hf_name in ("model.embed_tokens.weight", "lm_head.weight") and shard.world_size > 1:
                target = target[: tensor.shape[0]]  # the last rank may hold fewer real rows
            if tuple(target.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            if target_name in row_scale_buffers:
                assert row_scales is not None and tensor.dtype == E4M3, f"{hf_name}: no FP8 weight to keep"
                scale_target = row_scale_buffers[target_name]
                if rows is not None:
                    scale_target = scale_target[rows[0] : rows[1]]
                scale_target.copy_(row_scales)
                target.copy_(tensor)
            else:
                target.copy_(tensor.to(dtype))
            loaded.add(f"{target_name}[{rows}]" if rows is not None else target_name)
    _check_complete(spec, shard, params, loaded)
    if fp8_kv_cache and shard.rank == 0:
        _log_kv_scales(kv_scaled, spec.num_layers)
    model.rotary.build(device, dtype)
    return model.eval()


def _log_kv_scales(kv_scaled: dict[str, set[int]], num_layers: int) -> None:
    """Says which layers' FP8 cache scales came from the checkpoint; 1.0 elsewhere (as vLLM), which
    saturates keys or values beyond +-448."""
    if not kv_scaled["k"] and not kv_scaled["v"]:
        logger.warning("kv_cache_dtype fp8: the checkpoint has no KV cache scales; 1.0 for every layer")
        return
    for cache, layers in kv_scaled.items():
        missing = sorted(set(range(num_layers)) - layers)
        if missing:
            logger.warning(
                "kv_cache_dtype fp8: no %s scale in the checkpoint for layers %s; 1.0 there", cache, missing
            )
    logger.info(
        "kv_cache_dtype fp8: the checkpoint's KV cache scales for %d layers",
        len(kv_scaled["k"] | kv_scaled["v"]),
    )


def _set_kv_scale(model: CausalLM, hf_name: str, target: str, tensor: torch.Tensor) -> int:
    """Sets a layer's FP8 cache scale(s) from a checkpoint tensor ([1] or []); returns the layer."""
    if tensor.numel() != 1:
        raise ConfigError(
            f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}; a KV cache scale is one value"
        )
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0.0):
        raise ConfigError(
            f"checkpoint tensor {hf_name} is {value}; a KV cache scale must be finite and positive"
        )
    match = _LAYER_RE.match(hf_name)
    assert match is not None
    attention = model.layers[int(match.group(1))].self_attn
    if "k" in target:
        attention.k_scale = value
    if "v" in target:
        attention.v_scale = value
    return int(match.group(1))


def _read_config(model_dir: Path) -> dict[str, object]:
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


@torch.no_grad()
def _fill_random(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights in place: norms near 1 (as trained models have), matrices N(0, std). The
    norms are replicated on every rank, so they share one seed; the split matrices take `seed`."""
    device = next(model.parameters()).device
    replicated = torch.Generator(device=device).manual_seed(0)
    split = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():
        if param.dtype == E4M3:
            continue  # below
        if param.dim() == 1:
            param.normal_(1.0, 0.1, generator=replicated)
        else:
            param.normal_(0.0, std, generator=split)
    for _, linear in projections(model):
        if linear.weight.dtype == E4M3:  # N(0, std) weights quantized as the layer keeps them
            values = torch.empty(linear.weight.shape, dtype=torch.bfloat16, device=device)
            values.normal_(0.0, std, generator=split)
            if linear.weight_scale.dim() == 2:  # by 128 x 128 blocks
                weight, scale = fp8.quantize(values, fp8.KEPT_BLOCK_LAYOUT)
                linear.weight_scale.copy_(
                    fp8.group_scales(scale.cpu(), fp8.KEPT_BLOCK_LAYOUT, None, None, values.shape)
                )
            else:  # a row at a time, as online
                weight, scale = fp8.quantize(values, fp8.ONLINE_LAYOUT)
                linear.weight_scale.copy_(scale.view(-1))
            linear.weight.data.copy_(weight)


def _map_name(spec: ModelSpec, shard: ShardPlan, hf_name: str) -> tuple[str | None, tuple[int, int] | None]:
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None, None
    if hf_name == "lm_head.weight":
        return (None, None) if spec.tie_word_embeddings else ("lm_head.weight", None)
    if hf_name.startswith("model.") and not hf_name.startswith("model.layers."):
        return hf_name[len("model.") :], None
    match = _LAYER_RE.match(hf_name)
    if match is None:
        return hf_name, None
    layer, rest = match.groups()
    module, _, leaf = rest.rpartition(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{layer}.{fused}.{leaf}", _fused_slice(shard, spec, fused, part)
    return f"layers.{layer}.{rest}", None


def _check_complete(
    spec: ModelSpec, shard: ShardPlan, params: dict[str, torch.nn.Parameter], loaded: set[str]
) -> None:
    missing = []
    for name in params:
        fused = next(
            (f for f, _ in _FUSED.values() if name.endswith(f"{f}.weight") or name.endswith(f"{f}.bias")),
            None,
        )
        if fused is None:
            if name not in loaded:
                missing.append(name)
            continue
        parts = 3 if fused == "self_attn.qkv_proj" else 2
        for part in range(parts):
            if f"{name}[{_fused_slice(shard, spec, fused, part)}]" not in loaded:
                missing.append(f"{name} (part {part})")
    if missing:
        raise ConfigError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
