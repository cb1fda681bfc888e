"""The tokenizer's vocabulary as xgrammar sees it, built once per model."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import xgrammar


def build_tokenizer_info(
    model_dir: Path | str, vocab_size: int, eos_token_ids: Iterable[int]
) -> xgrammar.TokenizerInfo:
    """`vocab_size`: the model's logits width (padding ids past the tokenizer's vocabulary are never
    allowed); `eos_token_ids`: what ends a grammar (a matcher terminates on one of them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
    )
