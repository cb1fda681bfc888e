"""The built-in tiny model: byte-identical builds, real Qwen vocabulary, loadable by HF transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path

from paged_llm.models.hf_config import load_model_spec
from paged_llm.models.tiny_model import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, write_tiny_model


def _digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if not path.name.startswith(".")
    }


def test_every_build_is_byte_identical(tmp_path, tiny_model_dir):
    write_tiny_model(tmp_path / "again")
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert set(_digests(tmp_path / "again")) == expected
    assert _digests(tmp_path / "again") == _digests(tiny_model_dir)


def test_tokenizer_is_qwens_real_vocabulary(tiny_tokenizer):
    assert tiny_tokenizer("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT_ID,
        IM_START_ID,
        IM_END_ID,
    ]
    text = "你好，世界 🎉 café"
    assert tiny_tokenizer.decode(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    chat = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_spec_reads_qwen3_traits(tiny_model_dir):
    spec = load_model_spec(tiny_model_dir)
    assert spec.architecture == "Qwen3ForCausalLM" and spec.qk_norm and spec.tie_word_embeddings
    assert spec.num_kv_heads < spec.num_heads  # GQA
    assert spec.eos_token_ids == {IM_END_ID, ENDOFTEXT_ID}
