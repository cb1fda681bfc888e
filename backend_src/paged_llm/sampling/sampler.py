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
                math.inf if greedy or row.params.top_p >= 1.0 else row.params.top_p
                for row, greedy in zip(rows, greedy_flags)
            ]
            if any(value < 1.0 for value in top_p_values):
                top_p = column(top_p_values, torch.float32)

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
    assert metadata.temperatures is not None and metadata.noise_keys is not None
    work /= metadata.temperatures
    if metadata.min_p_log_ratios is not None:
        apply_min_p_(work, metadata.min_p_log_ratios)
    if metadata.top_k is not None or metadata.top_p is not None:
        work = apply_top_k_top_p(work, metadata.top_k, metadata.max_top_k, metadata.top_p)
    # argmax(log p - log E) = argmax(p / E): the exponential race, an exact categorical draw. -inf stays
    # -inf, so filtered tokens can never win.
    work -= exponential_noise(metadata.noise_keys, metadata.vocab_size).log_()
    return work.argmax(dim=-1)


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
