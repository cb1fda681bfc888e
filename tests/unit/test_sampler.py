"""Unit tests of the sampler: each SamplingParams knob on crafted logits, logprobs and reproducibility."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from paged_llm.sampling.noise import row_noise_key_int32, uniform_noise, uniform_noise_reference
from paged_llm.sampling.penalties import PenaltyMetadata, apply_penalties
from paged_llm.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    apply_top_k_top_p,
)
from paged_llm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_row(
    seed: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    suppressed: Sequence[int] = (),
    **params: Any,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        seed=seed,
        prompt_token_ids=tuple(prompt),
        output_token_ids=tuple(output),
        suppressed_token_ids=tuple(suppressed),
    )


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    metadata = SamplingMetadata.build(rows, vocab_size=logits.shape[1], device=logits.device)
    return Sampler()(logits, metadata)


def draw_many(logits_row: Sequence[float], num_draws: int, **params: Any) -> torch.Tensor:
    """Samples the same logits once per seed 0..num_draws-1, in one batch."""
    logits = torch.tensor([list(logits_row)] * num_draws, dtype=torch.float32)
    rows = [make_row(seed=seed, **params) for seed in range(num_draws)]
    return sample(logits, rows).sampled_token_ids


def frequencies(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab_size).to(torch.float64) / token_ids.numel()


def sampled_set(token_ids: torch.Tensor) -> set[int]:
    return set(token_ids.tolist())


# --- noise ---------------------------------------------------------------------------------------


def test_device_noise_matches_python_reference() -> None:
    # Guards the int32 wrap-around arithmetic: a backend that saturated or promoted would diverge.
    cases = [(0, 0), (1, 0), (1, 1), ((1 << 64) - 1, 7), (0xDEADBEEFCAFEF00D, 123456)]
    vocab_size = 200_003
    keys = torch.tensor([row_noise_key_int32(seed, pos) for seed, pos in cases], dtype=torch.int32)
    noise = uniform_noise(keys, vocab_size)
    for row, (seed, position) in enumerate(cases):
        for token in (0, 1, 2, 31, 65_537, vocab_size - 1):
            assert noise[row, token].item() == uniform_noise_reference(seed, position, token)


def test_noise_is_uniform_in_open_interval_and_varies_with_seed_and_position() -> None:
    keys = torch.tensor([row_noise_key_int32(7, 0), row_noise_key_int32(7, 1), row_noise_key_int32(8, 0)])
    noise = uniform_noise(keys, 100_000)
    assert bool((noise > 0).all()) and bool((noise < 1).all())
    assert abs(noise.mean().item() - 0.5) < 0.005
    assert abs(noise.var().item() - 1 / 12) < 0.002
    assert not torch.equal(noise[0], noise[1])  # same seed, next position
    assert not torch.equal(noise[0], noise[2])  # other seed, same position
    # Within a row consecutive tokens must not be correlated.
    lag_correlation = torch.corrcoef(torch.stack([noise[0, :-1], noise[0, 1:]]))[0, 1].item()
    assert abs(lag_correlation) < 0.02


# --- greedy --------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 1.0, 5.0, 0.0]], dtype=torch.bfloat16)
    output = sample(logits, [make_row(temperature=0.0), make_row(temperature=0.0, seed=9)])
    assert output.sampled_token_ids.tolist() == [1, 0]
    assert output.sampled_token_ids.dtype == torch.int64
    assert output.sampled_logprobs is None and output.topk_token_ids is None


def test_tiny_temperature_is_treated_as_greedy() -> None:
    # Uniform logits: any random draw would scatter; greedy always picks index 0.
    assert sampled_set(draw_many([1.0] * 16, 64, temperature=1e-7)) == {0}


def test_greedy_ignores_filters_and_is_independent_of_seed() -> None:
    tokens = draw_many([0.0, 2.0, 1.0], 32, temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)
    assert sampled_set(tokens) == {1}


# --- temperature ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax_of_scaled_logits(temperature: float) -> None:
    logits = [1.0, 0.5, 0.0, -1.0, 0.25]
    tokens = draw_many(logits, 20_000, temperature=temperature)
    expected = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=0)
    observed = frequencies(tokens, len(logits))
    # Standard error is <= 0.0036 per entry: 0.015 is ~4 sigma (and the draws are deterministic, so the
    # test cannot flake), while a wrong temperature moves some entry by > 0.05.
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


def test_small_temperature_is_near_greedy() -> None:
    tokens = draw_many([1.0, 2.0, 1.5, 0.0], 2000, temperature=0.02)
    assert sampled_set(tokens) == {1}


# --- filters -------------------------------------------------------------------------------------


def test_top_k_never_samples_outside_the_top_k() -> None:
    logits = [0.9, 1.0, 0.2, 0.95, 0.5, 0.8]  # top 2: indices 1 and 3
    tokens = draw_many(logits, 4000, top_k=2)
    assert sampled_set(tokens) == {1, 3}
    # Within the kept set the ratio follows the renormalised softmax.
    observed = frequencies(tokens, len(logits))[1].item()
    assert abs(observed - 1 / (1 + math.exp(-0.05))) < 0.03
    assert sampled_set(draw_many(logits, 200, top_k=1)) == {1}
    assert len(sampled_set(draw_many(logits, 4000, top_k=-1))) == len(logits)


def probs_to_logits(probs: Sequence[float]) -> list[float]:
    return [math.log(p) for p in probs]


@pytest.mark.parametrize(
    ("top_p", "expected_kept"),
    [(0.65, {1, 3}), (0.75, {1, 3, 2}), (0.05, {1}), (0.95, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p: float, expected_kept: set[int]) -> None:
    logits = probs_to_logits([0.1, 0.4, 0.2, 0.3])  # by probability: 1, 3, 2, 0
    filtered = apply_top_k_top_p(torch.tensor([logits]), None, 0, torch.tensor([[top_p]]))
    assert {i for i, v in enumerate(filtered[0].tolist()) if v != -math.inf} == expected_kept
    # Survivors keep their logits unchanged (the filter is a mask, not a rescale).
    for token in expected_kept:
        assert filtered[0, token].item() == pytest.approx(logits[token])
    assert sampled_set(draw_many(logits, 3000, top_p=top_p)) == expected_kept


def test_top_p_cut_inside_a_tie_keeps_the_lowest_ids() -> None:
    # Four equal probabilities of 0.25: the sums are exact, so the cut after two tokens is unambiguous.
    filtered = apply_top_k_top_p(torch.zeros(1, 4), None, 0, torch.tensor([[0.5]]))
    assert filtered[0].tolist() == [0.0, 0.0, -math.inf, -math.inf]


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    filtered = apply_top_k_top_p(logits.clone(), torch.tensor([[2]]), 2, None)
    assert filtered[0].tolist() == [-math.inf, 3.0, 2.0, 2.0, -math.inf]


def test_top_p_applies_after_top_k_on_renormalised_mass() -> None:
    # Top 3 renormalised: 0.444, 0.333, 0.222 -> mass above the third is 0.78 >= 0.75: dropped. Without
    # the renormalisation by top-k it would be 0.7 < 0.75 and kept.
    logits = probs_to_logits([0.1, 0.4, 0.2, 0.3])
    assert sampled_set(draw_many(logits, 3000, top_k=3, top_p=0.75)) == {1, 3}
    assert sampled_set(draw_many(logits, 3000, top_p=0.75)) == {1, 2, 3}


def test_min_p_drops_tokens_below_fraction_of_max_prob() -> None:
    logits = probs_to_logits([0.05, 0.5, 0.15, 0.3])
    assert sampled_set(draw_many(logits, 3000, min_p=0.2)) == {1, 2, 3}  # threshold 0.1
    assert sampled_set(draw_many(logits, 3000, min_p=0.5)) == {1, 3}  # threshold 0.25
    assert sampled_set(draw_many(logits, 3000, min_p=0.0)) == {0, 1, 2, 3}
    # min_p applies to the temperature-scaled distribution: at T=0.5 probs square, 0.15 falls below.
    assert sampled_set(draw_many(logits, 3000, min_p=0.2, temperature=0.5)) == {1, 3}


def test_filters_of_one_row_do_not_leak_into_others() -> None:
    logits = torch.zeros(60, 50)
    logits[0] = torch.arange(50, dtype=torch.float32) / 50  # distinct values: top_k=1 keeps only token 49
    rows = [make_row(seed=0, top_k=1, top_p=0.1, min_p=0.9), *(make_row(seed=s) for s in range(1, 60))]
    tokens = sample(logits, rows).sampled_token_ids
    assert tokens[0].item() == 49
    # The unfiltered uniform rows must still see the whole vocabulary across seeds.
    assert len(set(tokens[1:].tolist())) > 25


# --- penalties -----------------------------------------------------------------------------------


def penalize(logits: list[list[float]], rows: Sequence[SamplingRow]) -> torch.Tensor:
    vocab_size = len(logits[0])
    penalties = PenaltyMetadata.build(
        repetition_penalties=[r.params.repetition_penalty for r in rows],
        presence_penalties=[r.params.presence_penalty for r in rows],
        frequency_penalties=[r.params.frequency_penalty for r in rows],
        prompt_token_ids=[r.prompt_token_ids for r in rows],
        output_token_ids=[r.output_token_ids for r in rows],
        vocab_size=vocab_size,
        device=CPU,
    )
    return apply_penalties(torch.tensor(logits), penalties)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = [[2.0, 1.0, -1.0, -0.5, 3.0, 4.0]]
    rows = [make_row(prompt=[0, 3], output=[2, 2], repetition_penalty=2.0)]
    assert penalize(logits, rows).tolist() == [[1.0, 1.0, -2.0, -1.0, 3.0, 4.0]]


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0], [-0.5, -0.6, -3.0], [2.0, 1.5, 0.0]])
    rows = [
        make_row(temperature=0.0, prompt=[0], repetition_penalty=2.0),  # prompt token counts: 2 -> 1
        make_row(temperature=0.0, output=[0], repetition_penalty=2.0),  # negative: -0.5 -> -1.0
        make_row(temperature=0.0, prompt=[0]),  # no penalty: unaffected by its neighbours'
    ]
    assert sample(logits, rows).sampled_token_ids.tolist() == [1, 1, 0]


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    logits = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    rows = [
        make_row(prompt=[0, 0, 3], output=[1, 1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25),
        make_row(prompt=[0], output=[1, 1]),  # no penalty: must stay bit-identical
    ]
    penalized = penalize(logits, rows)
    assert penalized[0].tolist() == pytest.approx([1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0])
    assert penalized[1].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_negative_presence_penalty_encourages_seen_tokens() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    row = make_row(temperature=0.0, output=[1], presence_penalty=-0.5)
    assert sample(logits, [row]).sampled_token_ids.tolist() == [1]


# --- suppression ---------------------------------------------------------------------------------


def test_suppressed_ids_are_never_sampled() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    greedy = make_row(temperature=0.0, suppressed=[1])
    assert sample(logits, [greedy]).sampled_token_ids.tolist() == [2]
    tokens = draw_many([0.0, 5.0, 4.0, 1.0, 4.5], 3000, suppressed=[1, 4])
    assert sampled_set(tokens) == {0, 2, 3}


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_with_ranks_and_sorted_top_k() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 32) * 3
    rows = [
        make_row(temperature=0.0, suppressed=[int(logits[0].argmax())], logprobs=5),  # samples rank 2
        make_row(seed=3, temperature=0.7, top_k=4, repetition_penalty=1.5, output=[1, 2], logprobs=2),
        make_row(seed=4, temperature=1.5, logprobs=0),
        make_row(seed=5),  # does not ask: still gets (ignorable) values, K columns
    ]
    output = sample(logits, rows)
    assert output.sampled_logprobs is not None and output.sampled_ranks is not None
    assert output.topk_token_ids is not None and output.topk_logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)  # before suppression, penalties and temperature
    sampled = output.sampled_token_ids
    assert torch.allclose(output.sampled_logprobs, raw.gather(1, sampled[:, None]).squeeze(1))
    expected_ranks = [1 + int((raw[i] > raw[i, sampled[i]]).sum()) for i in range(4)]
    assert output.sampled_ranks.tolist() == expected_ranks
    assert output.sampled_ranks[0].item() == 2
    assert output.topk_token_ids.shape == (4, 5) and output.topk_token_ids.dtype == torch.int64
    assert torch.equal(output.topk_token_ids, raw.argsort(dim=-1, descending=True)[:, :5])
    assert torch.allclose(output.topk_logprobs, raw.gather(1, output.topk_token_ids))
    assert bool((output.topk_logprobs[:, :-1] >= output.topk_logprobs[:, 1:]).all())


def test_rank_counts_only_strictly_larger_logprobs() -> None:
    logits = torch.tensor([[3.0, 3.0, 1.0, 3.0]])
    output = sample(logits, [make_row(temperature=0.0, suppressed=[0], logprobs=0)])
    assert output.sampled_token_ids.tolist() == [1]
    assert output.sampled_ranks is not None and output.sampled_ranks.tolist() == [1]
    assert output.topk_token_ids is not None and output.topk_token_ids.shape == (1, 0)


def test_no_logprobs_work_when_no_row_asks() -> None:
    output = sample(torch.randn(2, 10), [make_row(seed=1), make_row(temperature=0.0, repetition_penalty=1.2)])
    assert output.sampled_logprobs is None and output.sampled_ranks is None
    assert output.topk_token_ids is None and output.topk_logprobs is None


# --- reproducibility -----------------------------------------------------------------------------


def reference_logits(vocab_size: int = 1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(vocab_size, generator=generator) * 0.5


def target_rows() -> list[SamplingRow]:
    """Random rows whose tokens are checked against every batch they are placed in."""
    return [
        make_row(seed=seed, output=[5] * position, top_k=top_k, top_p=0.9, repetition_penalty=1.1)
        for seed, position, top_k in [(11, 0, 0), (11, 1, 0), (12, 0, 50), ((1 << 64) - 1, 37, 0)]
    ]


def other_rows() -> list[SamplingRow]:
    return [
        make_row(temperature=0.0, logprobs=3),
        make_row(seed=99, top_k=5, min_p=0.1, frequency_penalty=1.0, output=[1, 2, 3]),
        make_row(seed=100, temperature=0.3, suppressed=[7, 8]),
        make_row(seed=101, presence_penalty=-1.0, prompt=[4] * 30, output=[9]),
        make_row(seed=11, output=[1, 2, 3, 4], temperature=2.0),  # same seed, other position
        make_row(seed=102, top_p=0.5),
    ]


def test_same_row_gives_same_token_alone_and_in_any_batch_position() -> None:
    logits_row = reference_logits()
    for target in target_rows():
        alone = sample(logits_row[None, :].clone(), [target]).sampled_token_ids.item()
        for position in (0, 3, 6):
            rows = other_rows()
            rows.insert(position, target)
            logits = torch.randn(7, logits_row.numel()) * 2
            logits[position] = logits_row
            torch.manual_seed(position)  # the global RNG must not matter
            tokens = sample(logits, rows).sampled_token_ids
            assert tokens[position].item() == alone, (target, position)


def test_different_seeds_and_positions_give_different_tokens() -> None:
    logits = torch.zeros(40, 1000)  # uniform: any shared noise would show up as equal tokens
    by_seed = sample(logits, [make_row(seed=seed) for seed in range(40)]).sampled_token_ids
    by_position = sample(logits, [make_row(seed=5, output=[0] * n) for n in range(40)]).sampled_token_ids
    assert len(set(by_seed.tolist())) > 35
    assert len(set(by_position.tolist())) > 35
    repeated = sample(logits, [make_row(seed=5, output=[0] * 3)] * 40).sampled_token_ids
    assert len(set(repeated.tolist())) == 1


def test_sampler_leaves_input_logits_untouched() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [
        make_row(seed=1, top_p=0.5, repetition_penalty=2.0, output=[1]),
        make_row(suppressed=[0]),
        make_row(temperature=0.0, logprobs=2),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


# --- validation ----------------------------------------------------------------------------------


def test_shape_mismatch_and_out_of_vocab_ids_are_rejected() -> None:
    metadata = SamplingMetadata.build([make_row()], vocab_size=10, device=CPU)
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(1, 11), metadata)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingMetadata.build([make_row(suppressed=[10])], vocab_size=10, device=CPU)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingMetadata.build([make_row(output=[3, 12], frequency_penalty=1.0)], vocab_size=10, device=CPU)


def test_token_sequences_may_be_numpy_arrays_or_cpu_tensors() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    rows = [
        SamplingRow(penalized, 0, np.array([0]), torch.tensor([2])),
        SamplingRow(SamplingParams(temperature=0.0), 0, np.array([0]), torch.tensor([], dtype=torch.int64)),
    ]
    assert sample(logits, rows).sampled_token_ids.tolist() == [1, 0]


def test_empty_batch_and_oversized_requests_are_handled() -> None:
    empty = SamplingMetadata.build([], vocab_size=10, device=CPU)
    assert Sampler()(torch.zeros(0, 10), empty).sampled_token_ids.shape == (0,)
    # More logprobs or a larger top_k than the vocabulary has: clamped, not an error.
    output = sample(torch.randn(1, 10), [make_row(seed=1, logprobs=20, top_k=50)])
    assert output.topk_token_ids is not None and output.topk_token_ids.shape == (1, 10)


def test_metadata_flags_are_host_values() -> None:
    rows = [make_row(temperature=0.0), make_row(temperature=0.0, logprobs=4), make_row(logprobs=2, top_k=3)]
    metadata = SamplingMetadata.build(rows, vocab_size=10, device=CPU)
    assert metadata.max_num_logprobs == 4 and metadata.max_top_k == 3
    assert metadata.any_greedy and not metadata.all_greedy and metadata.top_p is None
    plain = SamplingMetadata.build([make_row(temperature=0.0, top_k=3)], vocab_size=10, device=CPU)
    assert plain.is_plain_greedy and plain.noise_keys is None and plain.top_k is None


# --- CUDA (skipped without a GPU) ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_synchronisation() -> None:
    cuda = torch.device("cuda")
    rows = [*target_rows(), *other_rows()]
    logits = torch.randn(len(rows), 50_000) * 2
    expected = sample(logits, rows)
    metadata = SamplingMetadata.build(rows, vocab_size=logits.shape[1], device=cuda)
    cuda_logits = logits.to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        actual = Sampler()(cuda_logits, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(actual.sampled_token_ids.cpu(), expected.sampled_token_ids)
    assert actual.sampled_ranks is not None and expected.sampled_ranks is not None
    assert torch.equal(actual.sampled_ranks.cpu(), expected.sampled_ranks)
