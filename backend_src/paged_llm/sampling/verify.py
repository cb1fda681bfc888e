"""Verification of proposed tokens on the device, for the rows of one step's logits.

A sequence that verifies d proposals has d + 1 consecutive logits rows in the step (its last known
token, then each proposal): row j scores the token after proposal j. The result is padded to the
step's largest d:

    logits rows    t  d1  d2 | t' d1'          (two sequences, d = 2 and d = 1)
    out            [d1  e   -1]                 (d1 accepted, e emitted at the rejection of d2)
                   [d1' e'  -1]                 (all accepted: e' is the bonus token)
    num_emitted    [2, 2]

Greedy rows compare the proposals with the target argmax (exact: the tokens are those of decoding
one at a time). Random rows compare them with the token the sampler draws at each position (the
same draw as without speculation: counter-based noise keyed by seed and output position): for
proposals fixed before the step this is rejection sampling with a one-hot q (see _verify_sampled),
and a request's tokens do not depend on speculation or on its batch. sampling/rejection.py has
the general rule for proposals drawn from a draft distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_llm.sampling.rejection import REJECTED
from paged_llm.sampling.sampler import Sampler, SamplingMetadata, SamplingRow
from paged_llm.sampling.transfer import host_to_device
from paged_llm.sampling_params import GREEDY_TEMPERATURE_EPS
from paged_llm.sequence import Sequence


@dataclass
class VerifyRows:
    """Where each verifying sequence's rows sit in the step's logits (host side)."""

    seqs: list[Sequence]
    drafts: list[list[int]]
    first_rows: list[int]  # logits row of the sequence's last known token


@dataclass
class VerifyOutput:
    token_ids: torch.Tensor  # [B, kmax + 1] int64: accepted proposals, then one token; REJECTED after
    num_emitted: torch.Tensor  # [B] int64, 1..d + 1


def verify(logits: torch.Tensor, rows: VerifyRows, vocab_size: int) -> VerifyOutput:
    device = logits.device
    k = max(len(d) for d in rows.drafts)
    num_drafts = [len(d) for d in rows.drafts]
    # [B, k + 1] logits row of each (sequence, position); past a sequence's last row: that row again.
    row_index = [[first + min(j, n) for j in range(k + 1)] for first, n in zip(rows.first_rows, num_drafts)]
    padded = [d + [REJECTED] * (k - len(d)) for d in rows.drafts]
    index = host_to_device(torch.tensor(row_index, dtype=torch.int64), device)
    drafts = host_to_device(torch.tensor(padded, dtype=torch.int64), device)
    drafts_per_row = host_to_device(torch.tensor(num_drafts, dtype=torch.int64), device)
    if all(seq.sampling_params.temperature < GREEDY_TEMPERATURE_EPS for seq in rows.seqs):
        return _verify_greedy(logits, index, drafts, drafts_per_row)
    return _verify_sampled(logits, rows, index, drafts, drafts_per_row, vocab_size)


def _verify_greedy(
    logits: torch.Tensor, index: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> VerifyOutput:
    return _accept_matching(logits.argmax(dim=-1)[index], drafts, num_drafts)


def _accept_matching(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> VerifyOutput:
    """`target` [B, k + 1]: the token each position takes. Proposals are accepted while they equal
    it; then the target's token at the first mismatch (or after the last proposal) is emitted."""
    batch, width = target.shape
    k = width - 1
    device = target.device
    positions = torch.arange(k, device=device).unsqueeze(0)
    accepted = (drafts == target[:, :k]) & (positions < num_drafts.unsqueeze(-1))
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
    rows = torch.arange(batch, device=device)
    out = torch.where(
        torch.arange(k + 1, device=device).unsqueeze(0) < num_accepted.unsqueeze(-1),
        torch.cat([drafts, drafts[:, :1]], dim=1),
        REJECTED,
    )
    out[rows, num_accepted] = target[rows, num_accepted]
    return VerifyOutput(out, num_accepted + 1)


def _verify_sampled(
    logits: torch.Tensor,
    rows: VerifyRows,
    index: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    vocab_size: int,
) -> VerifyOutput:
    """Each position's token is the one the sampler draws there without speculation (its seed and
    output position key the noise: the exponential race argmax(p / E)); a proposal is accepted iff
    it is that token. For a proposal fixed before the step (n-gram, a greedy draft) this is the
    standard rule with a one-hot q: it is accepted with probability p(d), and on a rejection the
    emitted token follows the residual p without d (the race's winner, given it is not d). So the
    distribution is the target's, and a request's tokens are the same with speculation on or off
    and in any batch."""
    batch, width = index.shape
    sampling_rows = [
        SamplingRow(
            params=seq.sampling_params,
            seed=seq.seed,
            prompt_token_ids=(),
            # Only its length is read here: the output position, which keys the noise.
            output_token_ids=range(seq.num_output_tokens - seq.num_pending_tokens + j),
        )
        for seq in rows.seqs
        for j in range(width)
    ]
    metadata = SamplingMetadata.build(sampling_rows, vocab_size, logits.device)
    sampled = Sampler()(logits.index_select(0, index.reshape(-1)), metadata).sampled_token_ids
    return _accept_matching(sampled.view(batch, width), drafts, num_drafts)
