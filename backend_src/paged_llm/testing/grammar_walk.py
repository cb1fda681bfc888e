"""Grammar matchers walked to assorted states, for the bitmask tests and benchmarks."""

from __future__ import annotations

import random

import torch
import xgrammar

from paged_llm.sampling.token_bitmask import apply_token_bitmask_torch_
from paged_llm.structured_output.grammar import SequenceGrammar


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The tokens a [1, words] int32 bitmask allows, below `vocab_size`."""
    return (
        apply_token_bitmask_torch_(torch.zeros(1, vocab_size), bitmask_row)[0]
        .isfinite()
        .nonzero()
        .view(-1)
        .tolist()
    )


def walk_randomly(
    grammar: SequenceGrammar, num_tokens: int, rng: random.Random, vocab_size: int, eos_token_id: int
) -> None:
    """Advances `grammar` by up to `num_tokens` tokens, each drawn from those it allows but EOS (it
    stops early where it allows nothing else)."""
    scratch = torch.empty(xgrammar.get_bitmask_shape(1, vocab_size), dtype=torch.int32)
    for _ in range(num_tokens):
        grammar.matcher.fill_next_token_bitmask(scratch, 0)
        choices = [token for token in allowed_token_ids(scratch, vocab_size) if token != eos_token_id]
        if not choices:
            return
        assert grammar.accept_token(rng.choice(choices))
