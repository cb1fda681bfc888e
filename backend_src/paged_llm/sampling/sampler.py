"""Token sampler: penalties, greedy / temperature / min-p / top-k / top-p sampling and logprobs (vLLM v1).

Per step the model runner builds one `SamplingMetadata` from the batch's `SamplingRow`s (host side, may
loop over rows) and calls `Sampler()(logits, metadata)`. The call itself is batched on the device and
never synchronises with the host: every data-dependent decision (all greedy? any penalty? how many
logprobs?) was taken as a Python value in `SamplingMetadata.build`.

Randomness is counter-based (see `noise.py`): a row's token is a function of its seed, its output
position and its logits only, so it is the same alone, in any batch and at any batch position.
Sampling is the Gumbel-max trick, argmax(filtered_logits / T - log(E)) with E ~ Exp(1) per token, which
is an exact draw from softmax of the filtered, temperature-scaled logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_llm.sampling.noise import exponential_noise, row_noise_key_int32
from paged_llm.sampling.penalties import PenaltyMetadata, apply_penalties, flat_token_ids
from paged_llm.sampling.token_bitmask import apply_token_bitmask_
from paged_llm.sampling.transfer import host_to_device
from paged_llm.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams

# A row with 0 < top_k <= this many tokens resolves top-p on its top tokens (apply_top_k_top_p_window)
# instead of a sort of the whole vocabulary: the sort of a step's [B, V] logits costs more than the
# rest of the sampler. Qwen3's generation config asks top_k 20, top_p 0.95. A row's path depends
# on its own parameters only, so its tokens stay a function of the row.
TOP_P_WINDOW_TOKENS = 1024
# A top_p from here up is 1.0 in float32, where the cut would only keep or drop tokens by rounding:
# off, as 1.0 is.
TOP_P_OFF = 1.0 - 2.0**-25


@dataclass(frozen=True)
class SamplingRow:
    """One row of the batch: one sequence that samples one token this step."""

    params: SamplingParams  # the request's sampling parameters
    seed: int  # resolved unsigned 64-bit seed (filled by the engine for unseeded requests too)
    prompt_token_ids: Sequence[int]  # the prompt (only read for the repetition penalty)
    output_token_ids: Sequence[int]  # generated so far; the token being sampled gets index len(...)
    suppressed_token_ids: Sequence[int] = ()  # forced to -inf this step (EOS/stop ids below min_tokens)


@dataclass
class SamplingMetadata:
    """Everything `Sampler.__call__` needs for one step: device tensors plus host-side decisions."""

    num_rows: int  # B, rows of the logits
    vocab_size: int  # V, columns of the logits
    all_greedy: bool  # every row is greedy: no noise, no filters
    any_greedy: bool  # some row is greedy: the penalized argmax is needed
    greedy_mask: torch.Tensor | None  # [B] bool, True for greedy rows; None unless the batch is mixed
    temperatures: torch.Tensor | None  # [B, 1] float32 (1.0 on greedy rows); None when all greedy
    noise_keys: torch.Tensor | None  # [B] int32 hash keys of (seed, position); None when all greedy
    min_p_log_ratios: torch.Tensor | None  # [B, 1] float32 log(min_p), -inf = off; None if no row uses it
    top_k: torch.Tensor | None  # [B, 1] int64 tokens kept, 0 = off; None if no random row uses top-k
    max_top_k: int  # largest enabled top_k in the batch (0 when none): the width of `torch.topk`
    top_p: torch.Tensor | None  # [B, 1] float32 kept mass, inf = off; None if no random row uses top-p
    penalties: PenaltyMetadata | None  # None when no row has any penalty
    suppressed_flat_ids: torch.Tensor | None  # [S] int64 row * V + token to force to -inf; None if none
    max_num_logprobs: int | None  # K, the most top logprobs any row asked for; None: no row asked
    # [B, ceil(V / 32)] int32: the tokens each row's grammar allows (structured output; rows
    # without one allow all); None when no row is constrained
    token_bitmask: torch.Tensor | None = None
    # With top-p on: the rows resolved on their top tokens (0 < top_k <= the window) and the rows whose
    # vocabulary is sorted (every other row with a filter), each None when it is every row or none.
    window_rows: torch.Tensor | None = None  # [W] int64
    sort_rows: torch.Tensor | None = None  # [S] int64
    any_window_row: bool = False  # some row takes the window path
    any_sort_row: bool = False  # some row takes the sort path

    @property
    def is_plain_greedy(self) -> bool:
        """All rows greedy with nothing to modify or report: a bare argmax of the logits suffices."""
        return (
            self.all_greedy
            and self.penalties is None
            and self.suppressed_flat_ids is None
            and self.max_num_logprobs is None
            and self.token_bitmask is None
        )

    @staticmethod
    def build(
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        """Turns the step's rows into device tensors (host side; one transfer per tensor).
        `token_bitmask`: the rows' grammar bitmask, already on the device."""
        greedy_flags = [row.params.temperature < GREEDY_TEMPERATURE_EPS for row in rows]
        random_rows = [row for row, greedy in zip(rows, greedy_flags, strict=True) if not greedy]
        all_greedy = not random_rows
        any_greedy = any(greedy_flags)

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=dtype).unsqueeze(1), device)

        temperatures = noise_keys = min_p_log_ratios = top_k = top_p = None
        window_rows = sort_rows = None
        any_window_row = any_sort_row = False
        max_top_k = 0
        if not all_greedy:
            # Filters are meaningless for greedy rows, so they get the "off" value and do not switch on
            # a filter for the whole batch.
            temperatures = column(
                [1.0 if greedy else row.params.temperature for row, greedy in zip(rows, greedy_flags)],
                torch.float32,
            )
            noise_keys = host_to_device(
                torch.tensor(
                    [row_noise_key_int32(row.seed, len(row.output_token_ids)) for row in rows],
                    dtype=torch.int32,
                ),
                device,
            )
            if any(row.params.min_p > 0.0 for row in random_rows):
                min_p_log_ratios = column(
                    [
                        math.log(row.params.min_p) if row.params.min_p > 0.0 and not greedy else -math.inf
                        for row, greedy in zip(rows, greedy_flags)
                    ],
                    torch.float32,
                )
            # top_k >= V keeps everything: treat it as off so it cannot force a full-width topk.
            top_k_values = [
                0 if greedy or not 0 < row.params.top_k < vocab_size else row.params.top_k
                for row, greedy in zip(rows, greedy_flags)
            ]
            max_top_k = max(top_k_values, default=0)
            if max_top_k > 0:
                top_k = column(top_k_values, torch.int64)
            top_p_values = [
                math.inf if greedy or row.params.top_p >= TOP_P_OFF else row.params.top_p
                for row, greedy in zip(rows, greedy_flags)
            ]
            if any(value < TOP_P_OFF for value in top_p_values):
                top_p = column(top_p_values, torch.float32)
                window = min(TOP_P_WINDOW_TOKENS, vocab_size)
                window_indices = [i for i, k in enumerate(top_k_values) if 0 < k <= window]
                sort_indices = [
                    i
                    for i, (k, p) in enumerate(zip(top_k_values, top_p_values))
                    if not 0 < k <= window and (k > 0 or p < 1.0)
                ]
                any_window_row, any_sort_row = bool(window_indices), bool(sort_indices)
                if any_window_row and any_sort_row:  # a mixed batch: each path takes its rows
                    window_rows = host_to_device(torch.tensor(window_indices, dtype=torch.int64), device)
                    sort_rows = host_to_device(torch.tensor(sort_indices, dtype=torch.int64), device)

        greedy_mask = None
        if any_greedy and not all_greedy:
            greedy_mask = host_to_device(torch.tensor(greedy_flags, dtype=torch.bool), device)

        penalties = None
        if any(row.params.has_penalties for row in rows):
            penalties = PenaltyMetadata.build(
                repetition_penalties=[row.params.repetition_penalty for row in rows],
                presence_penalties=[row.params.presence_penalty for row in rows],
                frequency_penalties=[row.params.frequency_penalty for row in rows],
                prompt_token_ids=[row.prompt_token_ids for row in rows],
                output_token_ids=[row.output_token_ids for row in rows],
                vocab_size=vocab_size,
                device=device,
            )

        suppressed_rows = [index for index, row in enumerate(rows) if len(row.suppressed_token_ids) > 0]
        suppressed_flat_ids = None
        if suppressed_rows:
            suppressed_flat_ids = host_to_device(
                flat_token_ids(suppressed_rows, [row.suppressed_token_ids for row in rows], vocab_size),
                device,
            )

        asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        return SamplingMetadata(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            any_greedy=any_greedy,
            greedy_mask=greedy_mask,
            temperatures=temperatures,
            noise_keys=noise_keys,
            min_p_log_ratios=min_p_log_ratios,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            penalties=penalties,
            suppressed_flat_ids=suppressed_flat_ids,
            max_num_logprobs=min(max(asked), vocab_size) if asked else None,
            token_bitmask=token_bitmask,
            window_rows=window_rows,
            sort_rows=sort_rows,
            any_window_row=any_window_row,
            any_sort_row=any_sort_row,
        )


@dataclass
class SamplerOutput:
    """One step's sampled tokens and (when asked) their raw logprobs, all on the logits' device."""

    sampled_token_ids: torch.Tensor  # [B] int64
    sampled_logprobs: torch.Tensor | None  # [B] float32 raw logprob of the sampled token; None: none asked
    sampled_ranks: torch.Tensor | None  # [B] int64 1 + entries with a strictly larger logprob
    topk_token_ids: torch.Tensor | None  # [B, K] int64, by decreasing logprob; K = max asked (may be 0)
    topk_logprobs: torch.Tensor | None  # [B, K] float32 raw logprobs of `topk_token_ids`


class Sampler:
    """Stateless: all randomness comes from the rows' seeds via `SamplingMetadata.noise_keys`."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row of `logits` ([B, V], any float dtype, on the metadata's device)."""
        if logits.dim() != 2 or tuple(logits.shape) != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match the metadata's "
                f"({metadata.num_rows}, {metadata.vocab_size})"
            )
        if metadata.is_plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1), None, None, None, None)

        # A private float32 copy: everything below edits it in place, the caller's logits stay untouched.
        work = logits.to(dtype=torch.float32, copy=True)
        if metadata.token_bitmask is not None:  # the grammar first: every filter sees only what it allows
            apply_token_bitmask_(work, metadata.token_bitmask)
        if metadata.suppressed_flat_ids is not None:
            work.view(-1).index_fill_(0, metadata.suppressed_flat_ids, -math.inf)
        if metadata.penalties is not None:
            apply_penalties(work, metadata.penalties)

        greedy_ids = work.argmax(dim=-1) if metadata.any_greedy else None
        if metadata.all_greedy:
            assert greedy_ids is not None
            sampled_ids = greedy_ids
        else:
            random_ids = _sample_random(work, metadata)
            if greedy_ids is None:
                sampled_ids = random_ids
            else:
                assert metadata.greedy_mask is not None
                sampled_ids = torch.where(metadata.greedy_mask, greedy_ids, random_ids)

        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_ids, None, None, None, None)
        return _with_logprobs(logits, sampled_ids, metadata.max_num_logprobs)


def _sample_random(work: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then one Gumbel-max draw per row. Consumes `work`."""
    assert metadata.noise_keys is not None
    work = filter_logits_(work, metadata)
    # argmax(log p - log E) = argmax(p / E): the exponential race, an exact categorical draw. -inf stays
    # -inf, so filtered tokens can never win.
    work -= exponential_noise(metadata.noise_keys, metadata.vocab_size).log_()
    return work.argmax(dim=-1)


def filter_logits_(work: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The random rows' temperature, min-p, top-k and top-p on float32 logits; may edit in place."""
    assert metadata.temperatures is not None
    work /= metadata.temperatures
    if metadata.min_p_log_ratios is not None:
        apply_min_p_(work, metadata.min_p_log_ratios)
    if metadata.top_p is not None:
        return _apply_top_p_by_row(work, metadata)
    if metadata.top_k is not None:
        return apply_top_k_top_p(work, metadata.top_k, metadata.max_top_k, None)
    return work


def apply_min_p_(scaled_logits: torch.Tensor, min_p_log_ratios: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose prob < min_p * max prob, in place.

    prob_i / max_prob = exp(l_i - l_max), so the test is done on logits: no softmax needed, and
    min_p = 0 (log = -inf) drops nothing.
    """
    max_logits = scaled_logits.amax(dim=-1, keepdim=True)
    scaled_logits.masked_fill_(scaled_logits - max_logits < min_p_log_ratios, -math.inf)
    return scaled_logits


def apply_top_k_top_p(
    scaled_logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """Masks to -inf what top-k (then top-p, on the renormalised survivors) removes; may edit in place.

    top_k: [B, 1] int64, 0 = off. Ties with the k-th value are kept, as in vLLM.
    top_p: [B, 1] float32, inf = off. Keeps the smallest set of most probable tokens whose mass reaches
    top_p: a token survives iff the mass of the tokens ranked above it is still < top_p, so the top
    token always survives; among equal logits the lower token ids rank first.
    """
    if top_p is None:
        assert top_k is not None and max_top_k > 0
        # Only top-k: a partial topk is much cheaper than sorting the whole vocabulary.
        top_values = scaled_logits.topk(max_top_k, dim=-1).values
        kth_values = top_values.gather(1, (top_k - 1).clamp(min=0))
        thresholds = torch.where(top_k > 0, kth_values, -math.inf)
        return scaled_logits.masked_fill_(scaled_logits < thresholds, -math.inf)

    # Stable: equal logits stay in token order, so where the top-p cut falls inside a tie the lower ids
    # are kept, a function of the row alone (never of the sort kernel or the rest of the batch).
    sorted_logits, sorted_ids = scaled_logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth_values = sorted_logits.gather(1, (top_k - 1).clamp(min=0))
        thresholds = torch.where(top_k > 0, kth_values, -math.inf)
        sorted_logits.masked_fill_(sorted_logits < thresholds, -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_above >= top_p
    drop[:, 0] = False  # the top token always stays, whatever rounding did to its cumulative sum
    sorted_logits.masked_fill_(drop, -math.inf)
    return torch.empty_like(scaled_logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_top_p_by_row(work: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Top-k and top-p with top-p on in the batch: each row by the path its own parameters pick."""
    top_k, top_p = metadata.top_k, metadata.top_p
    assert top_p is not None
    if not metadata.any_window_row:
        return apply_top_k_top_p(work, top_k, metadata.max_top_k, top_p)
    assert top_k is not None  # a window row has one
    if not metadata.any_sort_row:
        return apply_top_k_top_p_window(work, top_k, top_p)
    assert metadata.window_rows is not None and metadata.sort_rows is not None
    window, ordered = metadata.window_rows, metadata.sort_rows
    work[window] = apply_top_k_top_p_window(work[window], top_k[window], top_p[window])
    work[ordered] = apply_top_k_top_p(work[ordered], top_k[ordered], metadata.max_top_k, top_p[ordered])
    return work


def apply_top_k_top_p_window(
    scaled_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    window_tokens: int = TOP_P_WINDOW_TOKENS,
) -> torch.Tensor:
    """apply_top_k_top_p's filter for rows with top_k <= `window_tokens` (top_k 0: the row is left
    as is), without sorting the vocabulary; edits in place.

    The top-p cut falls among the top-k survivors, so the row's `window_tokens` largest values (a
    partial topk) hold every survivor but ties of the k-th value, which all have one probability.
    The cut keeps the first m survivors in the order (value descending, token id ascending); the
    m-th survivor's value u then keeps every token above u and the lowest-id ties of u up to m.
    Same semantics as the sort; the sums run in another order, so a mass within rounding of top_p
    may fall on the other side.
    """
    window = min(window_tokens, scaled_logits.shape[1])
    values = top_values(scaled_logits, window)  # [B, W], descending
    kth = values.gather(1, (top_k - 1).clamp(min=0, max=window - 1))  # [B, 1]
    in_top_k = values >= kth
    num_in_window = in_top_k.sum(dim=-1, keepdim=True)
    # Ties of the k-th value past the window: survivors too.
    num_tail = (scaled_logits >= kth).sum(dim=-1, keepdim=True, dtype=torch.int32) - num_in_window
    # Unnormalised probabilities relative to the row's top value: exp(-inf) = 0 for masked tokens.
    weights = torch.where(in_top_k, (values - values[:, :1]).exp(), 0.0)
    cumulative = weights.cumsum(dim=-1)
    window_weight = cumulative[:, -1:]
    tail_weight = (kth - values[:, :1]).exp()  # each tie past the window
    total = window_weight + num_tail * tail_weight
    mass_above = (cumulative - weights) / total
    num_kept = (in_top_k & (mass_above < top_p)).sum(dim=-1, keepdim=True).clamp(min=1)
    # Past the window the j-th tie has (window_weight + j * tail_weight) / total above it.
    tail_room = (top_p * total - window_weight) / tail_weight.clamp(min=torch.finfo(torch.float32).tiny)
    # With top-p off the room is inf: every tie stays, whatever its weight. With top-p on, ties whose
    # weight underflowed to 0 have all the mass above them: the room is negative, none stays. NaN
    # (a row of -inf only) keeps none.
    num_tail_kept = torch.where(
        (num_kept == num_in_window) & ~tail_room.isnan(),
        tail_room.ceil().clamp(min=0).minimum(num_tail.to(tail_room.dtype)).to(torch.int64),
        0,
    )
    num_kept = num_kept + num_tail_kept
    last = torch.where(
        num_kept <= window, values.gather(1, (num_kept - 1).clamp(max=window - 1)), kth
    )  # u, the last kept survivor's value
    above = scaled_logits > last
    ties = scaled_logits == last
    # int32 throughout: an int64 quota would promote the [B, V] ranks to a copy.
    tie_quota = (num_kept - above.sum(dim=-1, keepdim=True, dtype=torch.int32)).to(torch.int32)
    keep = above | (ties & (ties.cumsum(dim=-1, dtype=torch.int32) <= tie_quota))
    keep |= top_k <= 0
    return scaled_logits.masked_fill_(~keep, -math.inf)


# Below this many rows a CUDA sort of the whole rows gives their top values sooner than torch.topk,
# whose one block per row made 1,024 of 151,936 values take ~0.7 ms on an H100 at 1 to 64 rows
# (docs/benchmarks/sampler.md); from 64 rows on the full sort path cost more than the window path.
# The crossover in between is an estimate.
SORT_FOR_TOP_VALUES_BELOW_ROWS = 32


def top_values(logits: torch.Tensor, num_values: int, by_sort: bool | None = None) -> torch.Tensor:
    """Each row's `num_values` largest values, descending: the same tensor whether a sort or topk
    finds them (values only, so ties cannot reorder anything). `by_sort` None: the faster one here."""
    if by_sort is None:
        by_sort = logits.is_cuda and logits.shape[0] < SORT_FOR_TOP_VALUES_BELOW_ROWS
    if by_sort:
        return logits.sort(dim=-1, descending=True).values[:, :num_values]
    return logits.topk(num_values, dim=-1).values


def _with_logprobs(logits: torch.Tensor, sampled_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    """Raw model logprobs (before a grammar's mask, suppression, penalties, temperature and
    filters: vLLM v1's default, raw_logprobs)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    sampled_logprobs = logprobs.gather(1, sampled_ids.unsqueeze(1))
    sampled_ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    topk_logprobs, topk_ids = logprobs.topk(num_top, dim=-1)
    return SamplerOutput(
        sampled_token_ids=sampled_ids,
        sampled_logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=sampled_ranks,
        topk_token_ids=topk_ids,
        topk_logprobs=topk_logprobs,
    )
