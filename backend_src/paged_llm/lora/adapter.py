"""A PEFT LoRA checkpoint read from disk and checked against the base model's shapes.

PEFT writes `adapter_config.json` and `adapter_model.safetensors` (or `adapter_model.bin`) with
tensors named `base_model.model.model.layers.{i}.{self_attn,mlp}.{q,k,v,o,gate,up,down}_proj.
lora_{A,B}.weight`: A is [rank, in_features], B [out_features, rank], and the projection's output
gains `B @ A @ x * scaling` with scaling = lora_alpha / rank (rsLoRA: lora_alpha / sqrt(rank)).
`rank_pattern` / `alpha_pattern` give some modules their own rank or alpha, matched as PEFT matches
them (a key matches a module name that ends with it, at a dot). Anything else PEFT can write
(DoRA, biases, `modules_to_save`, embedding or LM-head adapters, fan_in_fan_out) is refused with
a message naming the field or the tensor: serving it without it would give other outputs than
the adapter was trained for.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_llm.models.hf_config import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$"
)


# PEFT initialisations that subtract the adapter's start from the base weights: unconverted, such an
# adapter only works on that changed base
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the file, field or tensor."""


@dataclass(frozen=True)
class LoRAModule:
    """One projection's low-rank update: out += scaling * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    max_rank: int  # the largest rank of its modules
    # (layer index, module name such as "q_proj") -> its update
    modules: dict[tuple[int, str], LoRAModule]


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target (whole, unsharded)."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, intermediate = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def load_adapter(name: str, path: Path, spec: ModelSpec, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path` (a PEFT checkpoint directory) in float32 on the CPU, or
    LoRAAdapterError naming what cannot be served."""
    path = Path(path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    where = f"LoRA adapter {name!r} ({path})"
    shapes = module_shapes(spec)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise LoRAAdapterError(
                f"{where}: tensor {tensor_name!r} is not a LoRA A/B weight of a decoder projection "
                "(expected names such as base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight, "
                f"for {', '.join(TARGET_MODULES)}); embedding, LM-head, DoRA and bias adapters are not "
                "supported"
            )
        layer, block, module, side = int(match[1]), match[2], match[3], match[4]
        if module not in shapes or block != block_of(module):
            raise LoRAAdapterError(
                f"{where}: tensor {tensor_name!r} targets module {block}.{module}; supported: "
                + ", ".join(TARGET_MODULES)
            )
        if layer >= spec.num_layers:
            raise LoRAAdapterError(
                f"{where}: tensor {tensor_name!r} is for layer {layer}; the base model has "
                f"{spec.num_layers} layers"
            )
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise LoRAAdapterError(f"{where}: no LoRA weights in the checkpoint")
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, module), sides in sorted(pairs.items()):
        prefix = tensor_prefix(layer, module)
        for side in ("A", "B"):
            if side not in sides:
                raise LoRAAdapterError(f"{where}: tensor {prefix}.lora_{side}.weight is missing")
        a, b = sides["A"], sides["B"]
        in_features, out_features = shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        fits = a.dim() == 2 and a.shape[1] == in_features and tuple(b.shape) == (out_features, rank)
        if not fits:
            raise LoRAAdapterError(
                f"{where}: {prefix}.lora_A.weight {list(a.shape)} / lora_B.weight {list(b.shape)} do not "
                f"fit the base model's {module} ({in_features} in, {out_features} out): expected "
                f"[rank, {in_features}] / [{out_features}, rank]; an adapter of another base model?"
            )
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"{where}: {prefix} has rank {rank}, over max_lora_rank {max_lora_rank}")
        module_name = prefix.removeprefix("base_model.model.")
        alpha = float(_pattern_value(config.get("alpha_pattern"), module_name, config["lora_alpha"]))
        denominator = math.sqrt(rank) if config.get("use_rslora") else rank
        modules[(layer, module)] = LoRAModule(a.float(), b.float(), alpha / denominator)
    return LoRAAdapter(name, path, max(m.rank for m in modules.values()), modules)


def block_of(module: str) -> str:
    """The decoder block a projection belongs to in HF's module names."""
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def tensor_prefix(layer: int, module: str) -> str:
    """PEFT's name of a projection's LoRA tensors, up to `.lora_A.weight` / `.lora_B.weight`."""
    return f"base_model.model.model.layers.{layer}.{block_of(module)}.{module}"


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {path}: no {CONFIG_FILE} (a PEFT checkpoint directory?)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise LoRAAdapterError(f"{config_path}: not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path}: not a JSON object")

    def refuse(field: str, why: str) -> None:
        raise LoRAAdapterError(f"{config_path}: {field} {json.dumps(config.get(field))}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", "only LORA adapters are supported")
    if config.get("use_dora"):
        refuse("use_dora", "DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        refuse("bias", "adapters that train biases are not supported")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out", "transposed (Conv1D) layouts are not supported")
    if config.get("modules_to_save"):
        refuse("modules_to_save", "adapters that replace whole modules are not supported")
    if config.get("layer_replication"):
        refuse("layer_replication", "adapters that replicate layers are not supported")
    if config.get("lora_bias"):
        refuse("lora_bias", "LoRA biases are not supported")
    if config.get("alora_invocation_tokens"):
        refuse("alora_invocation_tokens", "activated LoRA (applied after invocation tokens) is not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        refuse(
            "init_lora_weights",
            "an adapter of this initialisation needs the base model it changed; convert it with PEFT "
            "(save_pretrained(..., path_initial_model_for_weight_conversion=...)) first",
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):  # names or dotted paths ending in one (a string is a regex)
        unknown = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in TARGET_MODULES)
        if unknown:
            supported = ", ".join(TARGET_MODULES)
            refuse("target_modules", f"{', '.join(unknown)} not supported (supported: {supported})")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        refuse("lora_alpha", "must be a positive number")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field) is not None and not isinstance(config[field], dict):
            refuse(field, "must be an object")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS_FILE).is_file():
        from safetensors.torch import load_file

        try:
            return load_file(path / WEIGHTS_FILE)
        except Exception as error:  # a truncated or foreign file: name it
            message = f"{path / WEIGHTS_FILE}: not a readable safetensors file: {error}"
            raise LoRAAdapterError(message) from None
    if (path / LEGACY_WEIGHTS_FILE).is_file():
        try:
            tensors = torch.load(path / LEGACY_WEIGHTS_FILE, map_location="cpu", weights_only=True)
        except Exception as error:
            raise LoRAAdapterError(f"{path / LEGACY_WEIGHTS_FILE}: not readable: {error}") from None
        if isinstance(tensors, dict) and all(isinstance(t, torch.Tensor) for t in tensors.values()):
            return tensors
        raise LoRAAdapterError(f"{path / LEGACY_WEIGHTS_FILE}: not a dict of tensors")
    raise LoRAAdapterError(f"LoRA adapter {path}: no {WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE}")


def _pattern_value(patterns: dict[str, Any] | None, module_name: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key that `module_name` ends with, at a dot."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default
