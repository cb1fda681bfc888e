"""Top-p resolved on a row's top tokens (apply_top_k_top_p_window) keeps what the sort of the whole
vocabulary keeps (apply_top_k_top_p): ties of the k-th value inside and past the window, a top-p cut
inside a tie, -inf entries, top-k alone; and each row of a batch takes the path its own parameters pick."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from paged_llm.sampling.sampler import (
    TOP_P_WINDOW_TOKENS,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_top_k_top_p,
    apply_top_k_top_p_window,
    filter_logits_,
    top_values,
)
from paged_llm.sampling_params import SamplingParams

# Few distinct values: ties everywhere, at the k-th value, at the cut, at the window's edge.
VALUES = [-math.inf, -2.0, -1.0, -0.5, 0.0, 0.25, 1.0, 1.5, 3.0]


def kept(filtered: torch.Tensor) -> list[set[int]]:
    """Each row's finite survivors (a -inf entry stays -inf whichever way it is filtered)."""
    return [{i for i, v in enumerate(row.tolist()) if v != -math.inf} for row in filtered]


def masses_above(row: list[float], k: int) -> list[float]:
    """Float64 mass above each top-k survivor in (value desc, id asc) order, for the rounding guard."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    kth = row[order[k - 1]] if k > 0 else -math.inf
    survivors = [row[i] for i in order if row[i] >= kth and row[i] != -math.inf]
    top = survivors[0]
    weights = [math.exp(max(v - top, -700.0)) for v in survivors]
    total = sum(weights)
    masses, above = [], 0.0
    for weight in weights:
        masses.append(above / total)
        above += weight
    return masses


@st.composite
def cases(draw):
    vocab_size = draw(st.integers(2, 24))
    window = draw(st.integers(1, vocab_size + 2))
    num_rows = draw(st.integers(1, 4))
    rows, top_ks, top_ps = [], [], []
    for _ in range(num_rows):
        # Scaled by 60, a value's weight under the top's underflows to 0 in float32.
        scale = draw(st.sampled_from([1.0, 60.0]))
        row = [
            scale * v
            for v in draw(st.lists(st.sampled_from(VALUES), min_size=vocab_size, max_size=vocab_size))
        ]
        assume(any(v != -math.inf for v in row))  # a grammar always leaves one token
        k = draw(st.integers(1, min(window, vocab_size)))
        p = draw(st.one_of(st.just(math.inf), st.floats(0.01, 0.999), st.floats(1e-9, 1e-3)))
        if p != math.inf:  # a mass within rounding of top_p may fall either way: not this test's subject
            assume(all(abs(m - p) > 1e-5 for m in masses_above(row, k)))
        rows.append(row)
        top_ks.append(k)
        top_ps.append(p)
    return rows, top_ks, top_ps, window


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_the_window_keeps_what_the_sort_keeps(case) -> None:
    rows, top_ks, top_ps, window = case
    logits = torch.tensor(rows, dtype=torch.float32)
    top_k = torch.tensor(top_ks, dtype=torch.int64).unsqueeze(1)
    top_p = torch.tensor(top_ps, dtype=torch.float32).unsqueeze(1)
    expected = kept(apply_top_k_top_p(logits.clone(), top_k, max(top_ks), top_p))
    got = kept(apply_top_k_top_p_window(logits.clone(), top_k, top_p, window_tokens=window))
    assert got == expected


def test_ties_of_the_kth_value_past_the_window_share_the_cut_by_id() -> None:
    # top_k 2 over [3, 1, 1, 1, 1, 1]: every 1.0 ties the 2nd value; a window of 2 holds one of them.
    # Token 0 has e^2 / (e^2 + 5) = 0.596 of the mass, each tie 0.081: the masses above the ties in id
    # order are 0.596, 0.677, 0.758, ...; top_p 0.7 keeps token 0 and the two lowest-id ties.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    top_k, top_p = torch.tensor([[2]]), torch.tensor([[0.7]])
    filtered = apply_top_k_top_p_window(logits.clone(), top_k, top_p, window_tokens=2)
    assert kept(filtered) == [{0, 1, 2}]
    assert kept(filtered) == kept(apply_top_k_top_p(logits.clone(), top_k, 2, top_p))


def test_ties_of_the_kth_value_whose_weight_underflows_stay_when_top_p_is_off() -> None:
    # e^-120 is 0 in float32: with top-p off the ties past the window are kept all the same, as
    # top-k alone keeps them (a row's kept set must not depend on whether its batch uses top-p).
    logits = torch.tensor([[-120.0, -120.0, 0.0]])
    filtered = apply_top_k_top_p_window(logits.clone(), torch.tensor([[2]]), torch.tensor([[math.inf]]), 2)
    assert kept(filtered) == [{0, 1, 2}]
    filtered = apply_top_k_top_p_window(logits.clone(), torch.tensor([[2]]), torch.tensor([[0.5]]), 2)
    assert kept(filtered) == [{2}]


def test_top_values_are_the_same_by_sort_and_by_topk() -> None:
    # The window path takes them by a sort on few CUDA rows, by topk otherwise: no result may change.
    logits = torch.tensor([[0.5, -math.inf, 2.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 3.0, -0.0, 1.0]])
    for num_values in (1, 3, 6):
        assert torch.equal(
            top_values(logits, num_values, by_sort=True), top_values(logits, num_values, by_sort=False)
        )


def test_top_k_off_leaves_the_row_as_is() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    filtered = apply_top_k_top_p_window(logits.clone(), torch.tensor([[0]]), torch.tensor([[0.1]]))
    assert torch.equal(filtered, logits)


def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [
        SamplingRow(params=p, seed=7 + i, prompt_token_ids=(), output_token_ids=())
        for i, p in enumerate(params)
    ]


def test_a_rows_tokens_do_not_depend_on_the_paths_the_other_rows_take() -> None:
    """A top_k 20 + top_p row draws the same token alone, beside a top-p-only row (sorted), and
    beside rows without filters."""
    torch.manual_seed(0)
    vocab_size = 3 * TOP_P_WINDOW_TOKENS
    logits = torch.randn(1, vocab_size) * 3
    windowed = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    batches = [
        [windowed],
        [SamplingParams(temperature=1.0, top_p=0.5), windowed],  # a sorted row first
        [SamplingParams(temperature=1.0), windowed, SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=0.9, top_k=2 * TOP_P_WINDOW_TOKENS, top_p=0.8), windowed],
    ]
    tokens = []
    for params in batches:
        rows = _rows(params)
        position = params.index(windowed)
        rows[position] = SamplingRow(params=windowed, seed=99, prompt_token_ids=(), output_token_ids=())
        metadata = SamplingMetadata.build(rows, vocab_size, torch.device("cpu"))
        batch = logits.repeat(len(rows), 1)
        tokens.append(Sampler()(batch, metadata).sampled_token_ids[position].item())
    assert len(set(tokens)) == 1, tokens


def test_the_path_is_picked_per_row() -> None:
    vocab_size = 4 * TOP_P_WINDOW_TOKENS
    cpu = torch.device("cpu")

    def build(*params: SamplingParams) -> SamplingMetadata:
        return SamplingMetadata.build(_rows(list(params)), vocab_size, cpu)

    only_window = build(SamplingParams(temperature=1.0, top_k=20, top_p=0.9), SamplingParams(temperature=1.0))
    assert only_window.any_window_row and not only_window.any_sort_row
    only_sort = build(SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=5))
    assert only_sort.any_sort_row and only_sort.any_window_row  # top_k 5 alone still takes the window
    wide = build(SamplingParams(temperature=1.0, top_k=TOP_P_WINDOW_TOKENS + 1, top_p=0.9))
    assert wide.any_sort_row and not wide.any_window_row
    mixed = build(
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0),
    )
    assert mixed.sort_rows is not None and mixed.sort_rows.tolist() == [0]
    assert mixed.window_rows is not None and mixed.window_rows.tolist() == [1]


ROW_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=0.8, top_k=3, top_p=0.6),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9),  # wider than the test's vocabulary: off
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=2, top_p=0.99999999),  # top_p 1.0 in float32: off
    SamplingParams(temperature=0.8, min_p=0.2, top_k=5, top_p=0.8),
]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(ROW_PARAMS) - 1), st.sampled_from([1.0, 60.0])), min_size=1, max_size=6
    ),
    st.integers(0, 2**32 - 1),
)
def test_each_rows_filtered_logits_are_the_same_alone_and_in_any_batch(rows, seed) -> None:
    """Through SamplingMetadata.build and the sampler's filter, a row's kept set and drawn token do
    not depend on the rows beside it (whose parameters may send the batch down other paths)."""
    from paged_llm.sampling import sampler as sampler_module

    vocab_size = 12
    generator = torch.Generator().manual_seed(seed)
    values = torch.tensor(VALUES[1:])
    logits = values[torch.randint(len(values), (len(rows), vocab_size), generator=generator)]
    logits *= torch.tensor([scale for _, scale in rows]).unsqueeze(1)
    params = [ROW_PARAMS[index] for index, _ in rows]

    def sample_rows(indices: list[int]) -> tuple[list[int], list[set[int]]]:
        """The rows' drawn tokens and kept sets (an all-greedy batch filters nothing)."""
        sampling_rows = [
            SamplingRow(params=params[i], seed=11 + i, prompt_token_ids=(), output_token_ids=())
            for i in indices
        ]
        metadata = SamplingMetadata.build(sampling_rows, vocab_size, torch.device("cpu"))
        tokens = Sampler()(logits[indices].clone(), metadata).sampled_token_ids.tolist()
        if metadata.all_greedy:
            return tokens, [set(range(vocab_size))] * len(indices)
        return tokens, kept(filter_logits_(logits[indices].clone(), metadata))

    saved = sampler_module.TOP_P_WINDOW_TOKENS
    sampler_module.TOP_P_WINDOW_TOKENS = 8  # smaller than the vocabulary: ties can fall past it
    try:
        together_tokens, together_kept = sample_rows(list(range(len(rows))))
        alone = [sample_rows([i]) for i in range(len(rows))]
    finally:
        sampler_module.TOP_P_WINDOW_TOKENS = saved
    assert together_tokens == [tokens[0] for tokens, _ in alone]
    for index, (_, kept_alone) in enumerate(alone):
        if params[index].temperature > 0:  # a greedy row's filters are off in any batch
            assert together_kept[index] == kept_alone[0], (index, params[index])
