"""Random-weight LoRA adapters in PEFT's file layout, for any base checkpoint (tests, benchmarks;
no downloads): `adapter_config.json` with the fields PEFT writes and `adapter_model.safetensors`
with its tensor names, so PEFT and the engine read the same file.

Unlike a freshly initialised PEFT adapter (B = 0, no effect), both A and B are random, sized so
that the update moves the projection's output by about `strength` of its own size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from paged_llm.lora.adapter import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_shapes, tensor_prefix
from paged_llm.models.hf_config import load_model_spec


def write_random_adapter(
    base_dir: Path,
    out_dir: Path,
    rank: int,
    seed: int = 0,
    lora_alpha: float | None = None,
    target_modules: tuple[str, ...] = TARGET_MODULES,
    use_rslora: bool = False,
    strength: float = 0.5,
    extra_config: dict[str, object] | None = None,
) -> Path:
    """Writes the adapter into `out_dir` and returns it. `lora_alpha` defaults to 2 * rank (PEFT's
    scaling 2); `extra_config` overrides fields of adapter_config.json (tests of refusals)."""
    spec = load_model_spec(Path(base_dir))
    alpha = float(2 * rank if lora_alpha is None else lora_alpha)
    scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
    generator = torch.Generator().manual_seed(seed)
    shapes = module_shapes(spec)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for module in target_modules:
            in_features, out_features = shapes[module]
            prefix = tensor_prefix(layer, module)
            # x ~ unit-variance features: A x has variance ~1 per rank row, B A x ~ rank * std_b^2;
            # the base output's rows are ~1 in size for the usual initialisations.
            a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
            b = torch.randn(out_features, rank, generator=generator) * (strength / math.sqrt(rank) / scaling)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }
    config.update(extra_config or {})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
