"""Loads the checkpoint's HF tokenizer (fast, local files only) and applies its chat template."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: Path) -> Any:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
