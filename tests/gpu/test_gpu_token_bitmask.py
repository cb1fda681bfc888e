"""The Triton token-bitmask kernel (structured output on CUDA) against the plain torch version: the
same tokens blocked, in float32, bfloat16 and float16 logits, for word-aligned and ragged
vocabularies and a padded bitmask; the runner's greedy token under a grammar (masked_argmax) against
the sampler's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from paged_llm.sampling.sampler import Sampler, SamplingMetadata, SamplingRow
from paged_llm.sampling.token_bitmask import apply_token_bitmask_, apply_token_bitmask_torch_, masked_argmax
from paged_llm.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "extra_words"), [(1, 32, 0), (7, 151_936, 0), (64, 128_256, 0), (3, 2_085, 2)]
)
def test_triton_bitmask_matches_torch(dtype, num_rows, vocab_size, extra_words):
    generator = torch.Generator(device="cuda").manual_seed(vocab_size + num_rows)
    num_words = -(-vocab_size // 32) + extra_words
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, device="cuda", generator=generator
    )
    bitmask[0, : num_words // 2] = 0  # whole words blocked, and whole words allowed
    bitmask[-1, num_words // 2 :] = -1
    logits = torch.randn(num_rows, vocab_size, device="cuda", generator=generator).to(dtype)
    expected = apply_token_bitmask_torch_(logits.clone(), bitmask)
    ours = apply_token_bitmask_(logits.clone(), bitmask)
    assert torch.equal(ours.isinf(), expected.isinf())
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_argmax_matches_the_sampler_on_the_device(dtype):
    num_rows, vocab_size = 64, 151_936
    generator = torch.Generator(device="cuda").manual_seed(3)
    bitmask = torch.randint(
        -(2**31),
        2**31 - 1,
        (num_rows, -(-vocab_size // 32)),
        dtype=torch.int32,
        device="cuda",
        generator=generator,
    )
    bitmask[::2, 100:] = 0  # a few allowed tokens only, for half the rows
    logits = torch.randn(num_rows, vocab_size, device="cuda", generator=generator).to(dtype)
    before = logits.clone()
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, [1], []) for _ in range(num_rows)]
    metadata = SamplingMetadata.build(rows, vocab_size, logits.device, token_bitmask=bitmask)
    assert torch.equal(masked_argmax(logits, bitmask), Sampler()(logits, metadata).sampled_token_ids)
    assert torch.equal(logits, before)
