"""Speculative decoding pieces on CPU: n-gram prompt lookup, and the rejection sampler (greedy
exactness, and a chi-square test that emitted tokens follow the target distribution)."""

from __future__ import annotations

import random

import torch

from paged_llm.sampling.rejection import REJECTED, rejection_sample
from paged_llm.spec_decode.ngram import NgramIndex, propose_ngram

# chi-square critical values at alpha = 0.001 by degrees of freedom (tables)
CHI2_CRITICAL_0_001 = {5: 20.515}


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 9, 8, 1, 2, 3]
    assert propose_ngram(tokens, 3, max_n=3) == [4, 9, 8]
    assert propose_ngram([5, 1, 2, 7, 1, 2, 6, 1, 2], 2, max_n=2) == [6, 1]  # the latest [1 2]
    assert propose_ngram([1, 2, 3, 4], 3) == []  # nothing recurs
    # The continuation runs into the end: the text repeats with the period the match implies.
    assert propose_ngram([7, 7, 7], 4, max_n=2) == [7, 7, 7, 7]
    assert propose_ngram([1, 2, 1], 5, max_n=3) == [2, 1, 2, 1, 2]
    assert propose_ngram([4, 1, 2, 3, 1, 2], 5, max_n=2) == [3, 1, 2, 3, 1]
    assert propose_ngram([3, 1, 2, 3], 2, max_n=3, min_n=2) == []  # only the 1-gram [3] recurs
    assert propose_ngram([1, 2, 3], 0) == []


def test_ngram_index_proposes_what_the_scan_proposes_as_a_sequence_grows():
    rng = random.Random(0)
    for _ in range(200):
        vocab, max_n = rng.choice([2, 3, 5, 20]), rng.randint(1, 5)
        min_n, k = rng.randint(1, max_n), rng.randint(1, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        index = NgramIndex(max_n, min_n)
        for _ in range(30):
            assert index.propose(tokens, k) == propose_ngram(tokens, k, max_n, min_n), (tokens, k)
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]


def _probs(batch: int, steps: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(batch, steps, vocab, generator=generator) * 2, dim=-1)


def test_greedy_rows_accept_exactly_the_target_argmax_prefix():
    generator = torch.Generator().manual_seed(0)
    batch, k, vocab = 6, 4, 11
    target = _probs(batch, k + 1, vocab, generator)
    greedy = target.argmax(-1)
    draft = greedy[:, :k].clone()
    for row in range(batch):  # row r: the first r drafts right (r = k, k+1: all right)
        if row < k:
            draft[row, row] = (draft[row, row] + 1) % vocab
    noise = torch.empty(batch, k + 1, vocab).exponential_(generator=generator)
    out, emitted = rejection_sample(
        target,
        draft,
        None,
        torch.rand(batch, k, generator=generator),
        noise,
        torch.ones(batch, dtype=torch.bool),
    )
    for row in range(batch):
        accepted = min(row, k)
        assert emitted[row] == accepted + 1
        assert out[row, : accepted + 1].tolist() == greedy[row, : accepted + 1].tolist()
        assert (out[row, accepted + 1 :] == REJECTED).all()


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _check_emitted_distribution(one_hot_draft: bool) -> None:
    """k = 2, crafted p_1, p_2, p_3 and q_1, q_2 over 6 tokens, drafts drawn from q: the first emitted
    token follows p_1, and the second, among rows that accepted the first draft, follows p_2."""
    generator = torch.Generator().manual_seed(1234)
    batch, k = 400_000, 2
    p = torch.tensor([
        [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
        [0.05, 0.05, 0.40, 0.30, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ])  # fmt: skip
    if one_hot_draft:  # the n-gram case: the proposal is fixed, q is one-hot at it
        draft = torch.tensor([[1, 3]]).expand(batch, k).clone()
        q = None
    else:
        q_rows = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10], [0.30, 0.10, 0.10, 0.10, 0.30, 0.10]])
        draft = torch.stack([torch.multinomial(q_rows[i], batch, replacement=True, generator=generator)
                             for i in range(k)], dim=1)  # fmt: skip
        q = q_rows.unsqueeze(0).expand(batch, k, 6)
    target = p.unsqueeze(0).expand(batch, k + 1, 6)
    out, emitted = rejection_sample(
        target, draft, q, torch.rand(batch, k, generator=generator),
        torch.empty(batch, k + 1, 6).exponential_(generator=generator), torch.zeros(batch, dtype=torch.bool),
    )  # fmt: skip
    critical = CHI2_CRITICAL_0_001[5]
    assert (emitted >= 1).all() and (out[:, 0] != REJECTED).all()
    assert _chi_square(out[:, 0], p[0]) < critical
    second = out[emitted >= 2]
    second = second[second[:, 0] == draft[emitted >= 2][:, 0], 1]
    assert second.numel() > 20_000
    assert _chi_square(second, p[1]) < critical
    # The first draft is accepted with probability sum_x min(p_1(x), q_1(x)).
    q_first = torch.zeros(6).scatter_(0, torch.tensor([1]), 1.0) if one_hot_draft else q[0, 0]
    rate = float(((emitted >= 2).double()).mean())
    assert abs(rate - float(torch.minimum(p[0], q_first).sum())) < 0.005


def test_emitted_tokens_follow_the_target_distribution_with_a_draft_distribution():
    _check_emitted_distribution(one_hot_draft=False)


def test_emitted_tokens_follow_the_target_distribution_with_one_hot_ngram_drafts():
    _check_emitted_distribution(one_hot_draft=True)


def test_verify_emits_tokens_that_follow_the_sampling_distribution():
    """The engine's verification (temperature, top-k, counter-based noise by seed and position):
    over 60,000 sequences with different seeds, a one-hot proposal at position 0 and a ragged
    second sequence layout, the first emitted token follows softmax(top-k(logits) / T), the second
    (after an accepted first proposal) the next position's, and the acceptance rate is p(draft)."""
    from paged_llm.sampling.verify import VerifyRows, verify
    from paged_llm.sampling_params import SamplingParams
    from paged_llm.sequence import Sequence

    vocab, temperature, top_k = 8, 0.7, 6
    row_logits = torch.tensor(
        [[1.0, 0.2, -0.5, 0.8, 0.0, -1.0, 0.4, -3.0], [0.1, 1.2, 0.3, -0.2, 0.9, 0.0, -0.7, -3.0]]
    )
    params = SamplingParams(max_tokens=100, temperature=temperature, top_k=top_k)
    num_seqs = 60_000
    seqs = [Sequence(f"s{i}", [1, 2], params, seed=i * 7919 + 3) for i in range(num_seqs)]
    # Every other sequence proposes 2 tokens (3 rows), the rest 1 (2 rows): ragged rows.
    drafts = [[0, 1] if i % 2 else [0] for i in range(num_seqs)]
    logits, first_rows = [], []
    for draft in drafts:
        first_rows.append(len(logits))
        logits.extend([row_logits[0], row_logits[1], row_logits[1]][: len(draft) + 1])
    result = verify(torch.stack(logits), VerifyRows(seqs, drafts, first_rows), vocab)

    def target(row: torch.Tensor) -> torch.Tensor:
        scaled = row / temperature
        kth = scaled.topk(top_k).values[-1]
        return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)

    p0, p1 = target(row_logits[0]), target(row_logits[1])
    critical = CHI2_CRITICAL_0_001[5]
    first = result.token_ids[:, 0]
    assert (result.num_emitted >= 1).all()
    assert _chi_square_support(first, p0) < critical
    accepted_first = result.num_emitted >= 2
    assert abs(float(accepted_first.double().mean()) - float(p0[0])) < 0.01
    second = result.token_ids[accepted_first, 1]
    assert _chi_square_support(second, p1) < critical


def _chi_square_support(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square over the tokens with positive probability (6 of 8 here: 5 degrees of freedom)."""
    support = probs > 0
    assert bool(support[samples].all()), "a token outside the filtered support was emitted"
    counts = torch.bincount(samples, minlength=probs.numel()).double()[support]
    expected = probs[support].double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_pause_doubles_while_speculation_does_not_pay_and_ends_when_it_does():
    from paged_llm.spec_decode.proposer import SpeculationPause

    pause = SpeculationPause(pause_below=0.5)
    pattern = []
    for _ in range(40):
        proposes = pause.proposes_now()
        pattern.append(proposes)
        if proposes:
            pause.on_verified(num_accepted=0)
    steps = [index for index, proposes in enumerate(pattern) if proposes]
    assert steps == [0, 2, 5, 10, 19, 36]  # pauses of 1, 2, 4, 8, 16 steps
    pause.steps_left = 0
    pause.on_verified(num_accepted=1)  # paid: no pause, and the next failure pauses 1 step again
    assert pause.proposes_now() and (pause.length, pause.steps_left) == (0, 0)
    pause.on_verified(num_accepted=0)
    assert pause.steps_left == 1
    never = SpeculationPause(pause_below=0.0)
    never.on_verified(num_accepted=0)
    assert never.proposes_now()
