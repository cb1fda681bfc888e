"""Verification of proposed tokens on the device, for the rows of one step's logits.

A sequence that verifies d proposals has d + 1 consecutive logits rows in the step (its last known
token, then each proposal): row j scores the token after proposal j. The result is padded to the
step's largest d:

    logits rows    t  d1  d2 | t' d1'          (two sequences, d = 2 and d = 1)
    out            [d1  e   -1]                 (d1 accepted, e emitted at the rejection of d2)
                   [d1' e'  -1]                 (all accepted: e' is the bonus token)
    num_emitted    [2, 2]

Greedy rows compare the proposals with the target argmax (exact: the tokens are those of decoding
one at a time). Random rows use rejection sampling (spec_decode/rejection.py) on the distribution
the sampler would draw from (temperature, min-p, top-k, top-p) with counter-based noise keyed by
(seed, output position), so a request's tokens depend on its seed, not on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_llm.sampling.noise import exponential_noise, row_noise_key_int32, uniform_noise
from paged_llm.sampling.sampler import SamplingMetadata, SamplingRow, filtered_scaled_logits
from paged_llm.sampling.transfer import host_to_device
from paged_llm.sampling_params import GREEDY_TEMPERATURE_EPS
from paged_llm.sequence import Sequence
from paged_llm.spec_decode.rejection import REJECTED, rejection_sample

_ACCEPT_SEED_SALT = 0x5EC0DEC0FFEE  # the accept tests' uniforms come from another stream than the draws


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
    batch, width = index.shape
    k = width - 1
    target = logits.argmax(dim=-1)[index]  # [B, k + 1]
    positions = torch.arange(k, device=logits.device).unsqueeze(0)
    accepted = (drafts == target[:, :k]) & (positions < num_drafts.unsqueeze(-1))
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
    rows = torch.arange(batch, device=logits.device)
    out = torch.where(
        torch.arange(k + 1, device=logits.device).unsqueeze(0) < num_accepted.unsqueeze(-1),
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
    batch, width = index.shape
    flat = index.reshape(-1)
    # One sampling row per (sequence, position): the position decides the noise.
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
    work = logits.index_select(0, flat).to(torch.float32)
    if metadata.temperatures is not None:
        work = filtered_scaled_logits(work, metadata)
    target_probs = work.softmax(dim=-1).view(batch, width, vocab_size)
    if metadata.noise_keys is not None:
        exponentials = exponential_noise(metadata.noise_keys, vocab_size).view(batch, width, vocab_size)
    else:
        exponentials = torch.ones_like(target_probs)
    accept_keys = [
        row_noise_key_int32(seq.seed ^ _ACCEPT_SEED_SALT, seq.num_output_tokens - seq.num_pending_tokens + j)
        for seq in rows.seqs
        for j in range(width - 1)
    ]
    if width > 1:
        keys = host_to_device(torch.tensor(accept_keys, dtype=torch.int32), logits.device)
        uniforms = uniform_noise(keys, 1).view(batch, width - 1)
    else:
        uniforms = torch.ones(batch, 0, device=logits.device)
    greedy_flags = [seq.sampling_params.temperature < GREEDY_TEMPERATURE_EPS for seq in rows.seqs]
    is_greedy = host_to_device(torch.tensor(greedy_flags, dtype=torch.bool), logits.device)
    out, num_emitted = rejection_sample(
        target_probs, drafts, None, uniforms, exponentials, is_greedy, num_draft_tokens=num_drafts
    )
    return VerifyOutput(out, num_emitted)
