"""Random-weight checkpoints in the shape of real models, for benchmarks and GPU tests (no downloads).

The tokenizer files are the built-in tiny model's (Qwen's real vocabulary). Models with a smaller
vocabulary (Llama 3's 128,256) only ever see token ids below their own vocabulary size in the
benchmarks, which the tokenizer still decodes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from paged_llm.models import fp8
from paged_llm.models.tiny_model import ensure_tiny_model

SHAPES: dict[str, dict[str, object]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Llama-3-70B: tensor-parallel benchmarks, with load_format=dummy (141 GB in bfloat16).
    "llama3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Llama-3.2-1B: a draft model for the Llama-3-8B shape (same vocabulary).
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Small Llama for GPU parity tests (same vocabulary as the tiny Qwen3 model).
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 151936,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def _weight_shapes(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    hidden = int(config["hidden_size"])
    head_dim = int(config["head_dim"])
    q_size = int(config["num_attention_heads"]) * head_dim
    kv_size = int(config["num_key_value_heads"]) * head_dim
    inter = int(config["intermediate_size"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (int(config["vocab_size"]), hidden)}
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (int(config["vocab_size"]), hidden)
    return shapes


# quantization_config as the published FP8 checkpoints write it (models/fp8.py has the layouts):
# Qwen3-*-FP8's four keys; compressed-tensors' FP8_DYNAMIC and FP8 (static per-tensor) presets.
_CT_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "dynamic": False,
    "group_size": None,
    "block_structure": None,
    "actorder": None,
    "observer": "minmax",
    "observer_kwargs": {},
}


def _compressed_tensors_config(strategy: str) -> dict[str, object]:
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
              "actorder": None, "observer_kwargs": {}}  # fmt: skip
    if strategy == "channel":
        inputs |= {"strategy": "token", "dynamic": True, "observer": None}
    else:
        inputs |= {"strategy": "tensor", "dynamic": False, "observer": "minmax"}
    group = {"targets": ["Linear"], "format": "float-quantized", "output_activations": None,
             "weights": _CT_WEIGHTS | {"strategy": strategy}, "input_activations": inputs}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "ignore": ["lm_head"],
        "sparsity_config": {},
        "config_groups": {"group_0": group},
    }


def fp8_quantization_config(layout: str, block: tuple[int, int] = (128, 128)) -> dict[str, object]:
    """config.json's quantization_config for a random checkpoint in `layout` (fp8.LAYOUTS)."""
    if layout == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(block)}  # fmt: skip
    if layout in ("fp8-channel", "fp8-tensor"):
        return _compressed_tensors_config(layout.removeprefix("fp8-"))
    raise ValueError(f"unknown FP8 layout {layout!r} (known: {', '.join(fp8.LAYOUTS)})")


def write_random_model(
    out_dir: Path,
    shape: str,
    dtype: str = "bfloat16",
    seed: int = 0,
    device: str = "cpu",
    std: float = 0.02,
    config_overrides: dict[str, object] | None = None,
    with_weights: bool = True,
    quantization: str | None = None,
    fp8_block: tuple[int, int] = (128, 128),
) -> Path:
    """Writes config.json, generation_config.json, tokenizer files and random safetensors weights.
    `config_overrides`: values that replace the shape's (e.g. an odd vocab_size in tests).
    `with_weights` False: no weights, for an engine with load_format "dummy". `quantization`: an
    FP8 layout (fp8.LAYOUTS): the projections are written quantized in it, with its scale tensors
    (`fp8_block`: fp8-block's weight_block_size), as the published checkpoints have them."""
    out_dir = Path(out_dir)
    if (out_dir / ".complete").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape]) | (config_overrides or {}) | {"torch_dtype": dtype}
    if quantization is not None:
        config["quantization_config"] = fp8_quantization_config(quantization, fp8_block)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    eos = config["eos_token_id"]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny / name, out_dir / name)
    if not with_weights:
        (out_dir / ".complete").write_text("config only\n")
        return out_dir
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    shapes = _weight_shapes(config)
    for name, tensor_shape in tqdm(shapes.items(), desc=f"random {shape}", unit="tensor"):
        if len(tensor_shape) == 1:  # norm weights near 1, as trained models have
            values = 1.0 + 0.1 * torch.randn(tensor_shape, generator=generator, device=device)
        else:
            values = std * torch.randn(tensor_shape, generator=generator, device=device)
        tensors[name] = values.to(torch_dtype)
    if quantization is not None:
        _quantize_projections(tensors, fp8.detect_fp8_layout(config), torch_dtype)
    tensors = {name: tensor.cpu() for name, tensor in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / ".complete").write_text("ok\n")
    return out_dir


def _quantize_projections(
    tensors: dict[str, torch.Tensor], layout: fp8.Fp8Layout | None, dtype: torch.dtype
) -> None:
    """The projections' weights in place of their values: fp8 with the layout's scale tensors in
    the checkpoint's dtype (as compressed-tensors and Qwen3-*-FP8 write them); fp8-tensor also has
    its static activation scale."""
    assert layout is not None
    for name in [n for n in tensors if n.startswith("model.layers.")]:
        layer_name = name.split(".", 3)[3]
        if not fp8.is_projection_weight(layer_name):
            continue
        module = name[: -len(".weight")]
        tensors[name], tensors[f"{module}.{layout.scale_suffix}"] = fp8.quantize(tensors[name], layout, dtype)
        if layout.kind == "fp8-tensor":
            tensors[f"{module}.input_scale"] = torch.ones(1, dtype=dtype, device=tensors[name].device)
