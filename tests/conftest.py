from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels are tested through Triton's CPU interpreter. The switch is read when a
# kernel is decorated, so it must be set before any test module imports paged_llm's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from paged_llm.models.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from paged_llm.tokenizer.hf_tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer) -> list[list[int]]:
    """16+ prompts of mixed lengths (2 to ~300 tokens), some sharing a long prefix."""
    texts = [
        "Hi",
        "The quick brown fox jumps over the lazy dog.",
        "你好，世界！今天天气怎么样？",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Paged attention stores the KV cache in fixed-size blocks " * 6,
        "A",
        "Emoji 🎉 and accents: café, naïve, Zürich.",
        "Numbers 1234567890 and symbols !@#$%^&*()",
        "In a hole in the ground there lived a hobbit. " * 14,
        "Continuous batching schedules new requests every step",
        "Short",
        "Long context: " + " ".join(f"item{i}" for i in range(120)),
        "The mitochondria is the powerhouse of the cell",
        "SELECT * FROM users WHERE id = 42;",
        "Once upon a time",
        "Triton Inference Server streams tokens over gRPC",
        "Translate to French: the cat sits on the mat",
        "Q: What is 2+2?\nA:",
    ]
    return [list(tiny_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
