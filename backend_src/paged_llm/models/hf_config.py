"""Reads an HF checkpoint directory's config.json / generation_config.json into a typed ModelSpec."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paged_llm.config import ConfigError

# Architectures this engine implements, and how they differ from plain Llama.
_ARCHITECTURES = {
    "LlamaForCausalLM": {"qk_norm": False, "default_attention_bias": False},
    "Qwen3ForCausalLM": {"qk_norm": True, "default_attention_bias": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "default_attention_bias": True},
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling_type: str | None = None  # None (plain RoPE) or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    checkpoint_dtype: str  # "bfloat16", "float16" or "float32"
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


def load_model_spec(model_dir: Path) -> ModelSpec:
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} not found: `model` must be an HF checkpoint directory")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    architectures = config.get("architectures") or []
    architecture = next((name for name in architectures if name in _ARCHITECTURES), None)
    if architecture is None:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise ConfigError(
            f"unsupported architecture {architectures} in {config_path} (supported: {supported})"
        )
    traits = _ARCHITECTURES[architecture]
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden_size // num_heads)
    return ModelSpec(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope_spec(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", traits["default_attention_bias"])),
        qk_norm=bool(traits["qk_norm"]),
        checkpoint_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        eos_token_ids=_eos_token_ids(Path(model_dir), config),
    )


def _rope_spec(config: dict[str, Any]) -> RopeSpec:
    # transformers 4.x: rope_theta + rope_scaling; transformers 5.x: rope_parameters.
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    scaling_type = merged.get("rope_type") or merged.get("type")
    if scaling_type in (None, "default"):
        return RopeSpec(theta=theta)
    if scaling_type != "llama3":
        raise ConfigError(f"unsupported rope scaling {scaling_type!r} (supported: default, llama3)")
    return RopeSpec(
        theta=theta,
        scaling_type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, list):
        return {int(v) for v in value}
    return {int(value)}


def _eos_token_ids(model_dir: Path, config: dict[str, Any]) -> frozenset[int]:
    """EOS ids as HF generate uses them: generation_config.json's list, else config.json's."""
    ids = _as_id_set(config.get("eos_token_id"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text(encoding="utf-8"))
        ids |= _as_id_set(generation.get("eos_token_id"))
    return frozenset(ids)
