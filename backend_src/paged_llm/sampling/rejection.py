"""Verifying proposed tokens against the target model (Leviathan et al. 2023; Chen et al. 2023).

For each sequence, k draft tokens d_1..d_k with draft distributions q_i, and the target's
distributions p_1..p_{k+1} from one step that scored all of them:

    i = 1..k:  accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
               on the first rejection emit a token from the residual max(0, p_i - q_i) (normalised)
               and stop;
    all accepted: emit a bonus token from p_{k+1}.

Every emitted token then follows the target distribution exactly. Greedy rows accept d_i iff it is
argmax p_i and emit argmax of the first mismatching p_i (or of p_{k+1}). An n-gram proposer has a
one-hot q (pass `draft_probs=None`): accept with probability p_i(d_i), residual = p_i without d_i.

Randomness comes in as tensors, so that a caller can make each row depend only on its own request
(sampling/noise.py): `uniforms` [B, k] for the accept tests and `exponentials` [B, k + 1, V] (Exp(1)
noise) for the draws: argmax(probs / exponentials) is a sample of probs (the exponential race).
"""

from __future__ import annotations

import torch

REJECTED = -1  # output_token_ids past a row's num_emitted


def sample_with_exponentials(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1): one draw from each row of `probs` (last dim)."""
    return torch.argmax(probs / exponentials, dim=-1)


def rejection_sample(
    target_probs: torch.Tensor,  # [B, k + 1, V]
    draft_token_ids: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V]; None: one-hot at the draft tokens (n-gram)
    uniforms: torch.Tensor,  # [B, k] in (0, 1)
    exponentials: torch.Tensor,  # [B, k + 1, V] Exp(1) noise
    is_greedy: torch.Tensor,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output_token_ids [B, k + 1], num_emitted [B]): each row's accepted draft tokens followed by
    one token (the correction, or the bonus when all were accepted); REJECTED after that."""
    batch, k = draft_token_ids.shape
    device = target_probs.device
    draft = draft_token_ids.long()
    p_draft = target_probs[:, :k].gather(2, draft.unsqueeze(-1)).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft.unsqueeze(-1)).squeeze(-1)
    greedy_tokens = target_probs.argmax(dim=-1)  # [B, k + 1]
    accept_sampled = uniforms * q_draft <= p_draft  # u < p/q without dividing by a zero q
    accept_greedy = draft == greedy_tokens[:, :k]
    accepted = torch.where(is_greedy.unsqueeze(-1), accept_greedy, accept_sampled)
    # Number of leading accepted drafts: the first rejection ends the run.
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)  # [B]

    # The token after the accepted run: from the residual at the rejected position, or the bonus.
    if draft_probs is None:
        one_hot = torch.zeros_like(target_probs[:, :k]).scatter_(2, draft.unsqueeze(-1), 1.0)
        residual = (target_probs[:, :k] - one_hot).clamp_min(0.0)
    else:
        residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)
    # A residual of zero mass (p == q there) cannot be rejected from; guard the division anyway.
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    next_dists = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k + 1, V]
    rows = torch.arange(batch, device=device)
    dist = next_dists[rows, num_accepted]  # [B, V]
    sampled_next = sample_with_exponentials(dist, exponentials[rows, num_accepted])
    next_token = torch.where(is_greedy, greedy_tokens[rows, num_accepted], sampled_next)

    positions = torch.arange(k + 1, device=device).unsqueeze(0)  # [1, k + 1]
    padded_draft = torch.cat([draft, torch.full((batch, 1), REJECTED, device=device, dtype=torch.long)], 1)
    output = torch.where(positions < num_accepted.unsqueeze(-1), padded_draft, REJECTED)
    output[rows, num_accepted] = next_token
    return output, num_accepted + 1
