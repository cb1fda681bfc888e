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


def test_step_bitmask_reaches_the_device_behind_a_busy_stream(tiny_model_dir):
    """StepBitmask copies each mask on its own stream into one of two device buffers while the
    current stream is busy (a forward stand-in); the sampling that follows on the current stream
    sees that step's mask, step after step, through both buffers and the same buffer twice."""
    import xgrammar

    from paged_llm.structured_output.grammar import SequenceGrammar, StepBitmask
    from paged_llm.structured_output.tokenizer_info import build_tokenizer_info

    vocab_size, eos = 151_936, 151_645
    info = build_tokenizer_info(tiny_model_dir, vocab_size, [eos])
    compiled = xgrammar.GrammarCompiler(info).compile_regex("(ab|cd){2,40}e")

    class Row:
        def __init__(self, grammar):
            self.grammar = grammar

    rows = [Row(SequenceGrammar(compiled) if index % 3 else None) for index in range(64)]
    busy = torch.randn(4096, 4096, device="cuda")
    bitmask = StepBitmask(64, vocab_size, torch.device("cuda"), pin_memory=True)
    try:
        for step in range(12):
            for index, row in enumerate(rows):  # the rows move on: each step's mask differs
                if row.grammar is not None and step:
                    row.grammar.matcher.accept_string("ab" if (index + step) % 2 else "cd")
            expected = torch.full(xgrammar.get_bitmask_shape(64, vocab_size), -1, dtype=torch.int32)
            for index, row in enumerate(rows):
                if row.grammar is not None:
                    row.grammar.matcher.fill_next_token_bitmask(expected, index)
            for _ in range(4):
                busy = busy @ busy / 64  # keeps the current stream busy while the mask goes up
            on_device = bitmask.finish(bitmask.start(rows)) if step % 4 != 3 else bitmask.fill(rows)
            seen = on_device.clone()  # on the current stream, after the copy
            torch.cuda.synchronize()
            assert torch.equal(seen.cpu(), expected), f"step {step}"
    finally:
        bitmask.close()


@pytest.mark.parametrize("vocab_size", [1, 4_096, 4_097, 128_256, 151_936])
def test_masked_argmax_kernel_breaks_ties_as_torch(vocab_size):
    """The one-pass masked argmax: the lowest allowed token among equal maxima, across the
    kernel's chunks; a row with nothing allowed gives token 0, as argmax over -inf does."""
    generator = torch.Generator(device="cuda").manual_seed(vocab_size)
    num_words = -(-vocab_size // 32)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (8, num_words), dtype=torch.int32, device="cuda", generator=generator
    )
    bitmask[0] = 0
    logits = torch.randint(-2, 2, (8, vocab_size), device="cuda", generator=generator).to(torch.bfloat16)
    expected = apply_token_bitmask_torch_(logits.clone().float(), bitmask).argmax(dim=-1)
    assert torch.equal(masked_argmax(logits, bitmask), expected)
