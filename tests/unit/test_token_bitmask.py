"""The sampler's token bitmask (structured output) against xgrammar's plain-torch kernel: same bits,
same -inf, for any row count, vocabulary size (word-aligned or not) and bit pattern. (xgrammar
0.2.9's C++ CPU kernel blocked an allowed token in one row of a generated 4-row case; not chased.)"""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.sampling.sampler import Sampler, SamplingMetadata, SamplingRow
from paged_llm.sampling.token_bitmask import (
    apply_token_bitmask_,
    apply_token_bitmask_torch_,
    masked_argmax,
    masked_argmax_triton,
)
from paged_llm.sampling_params import SamplingParams


@settings(max_examples=60, deadline=None)
@given(
    num_rows=st.integers(1, 5),
    vocab_size=st.integers(1, 200),
    extra_words=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_bitmask_blocks_what_xgrammar_blocks(
    num_rows: int, vocab_size: int, extra_words: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_words = -(-vocab_size // 32) + extra_words  # xgrammar's width, or wider (a padded vocabulary)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=generator
    )
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size, backend="torch_native")
    ours = apply_token_bitmask_(logits.clone(), bitmask)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert torch.equal(apply_token_bitmask_torch_(logits.clone(), bitmask), ours)


def test_bit_order_within_a_word() -> None:
    """Bit t of word w allows token 32w + t: one allowed token per row, anywhere in its word."""
    vocab_size = 70
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    allowed = [0, 31, 69]
    for row, token in enumerate(allowed):
        word, bit = divmod(token, 32)
        bitmask[row, word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)  # bit 31: negative
    logits = apply_token_bitmask_(torch.zeros(3, vocab_size), bitmask)
    for row, token in enumerate(allowed):
        assert logits[row].isfinite().nonzero().view(-1).tolist() == [token]
        assert logits[row, token - 1 if token else token + 1] == -math.inf


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(1, 5),
    vocab_size=st.integers(2, 200),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_masked_argmax_is_the_samplers_greedy_token(num_rows, vocab_size, dtype, seed) -> None:
    """The runner's greedy path under a grammar (masked_argmax, no sampling metadata) takes the
    token the sampler takes for greedy rows with that bitmask, and leaves the logits as they were
    (ties included: bf16 logits of a small range tie often)."""
    generator = torch.Generator().manual_seed(seed)
    num_words = -(-vocab_size // 32)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=generator
    )
    logits = torch.randint(-4, 4, (num_rows, vocab_size), generator=generator).to(dtype)
    before = logits.clone()
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, [1], []) for _ in range(num_rows)]
    metadata = SamplingMetadata.build(rows, vocab_size, logits.device, token_bitmask=bitmask)
    expected = Sampler()(logits, metadata).sampled_token_ids
    assert torch.equal(masked_argmax(logits, bitmask), expected)
    assert torch.equal(logits, before)


@settings(max_examples=25, deadline=None)
@given(
    num_rows=st.integers(1, 4),
    vocab_size=st.integers(1, 9_000),
    extra_words=st.integers(0, 2),
    blocked_row=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_masked_argmax_kernel_is_the_torch_versions(
    num_rows, vocab_size, extra_words, blocked_row, dtype, seed
) -> None:
    """The one-pass Triton masked argmax (CUDA's greedy token under a grammar; here through Triton's
    interpreter, compiled on a GPU) against the torch version: ties to the lowest token across the
    kernel's 4096-token chunks, a row with nothing allowed gives 0, a padded bitmask is ignored."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(seed)
    num_words = -(-vocab_size // 32) + extra_words
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=generator
    )
    if blocked_row:
        bitmask[0] = 0
    logits = torch.randint(-3, 3, (num_rows, vocab_size), generator=generator).to(dtype)
    expected = apply_token_bitmask_torch_(logits.clone(), bitmask).argmax(dim=-1)
    ours = masked_argmax_triton(logits.to(device), bitmask.to(device)).cpu()
    assert torch.equal(ours, expected)
