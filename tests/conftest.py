from __future__ import annotations

from pathlib import Path

import pytest

from paged_llm.models.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from paged_llm.tokenizer.hf_tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)
