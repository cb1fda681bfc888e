"""Masking logits with a packed token bitmask (structured output): bit t of a row's int32 words
(word t // 32, bit t % 32) allows token t; every other token's logit becomes -inf.

Plain torch, so it runs wherever the sampler does: the bitmask's bytes index a 256 x 8 table of
their bits, one bool per token (B x V bytes of temporaries, only on steps with a constrained row)."""

from __future__ import annotations

import math

import torch

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    table = _BYTE_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        table = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
        _BYTE_BITS[device] = table
    return table


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets logits[r, t] to -inf where bit t of bitmask[r] is 0, in place. `logits` [B, V] float;
    `bitmask` [B, ceil(V / 32)] int32 on the same device (little-endian words: byte k of word w
    holds tokens 32w + 8k .. 32w + 8k + 7)."""
    num_rows, vocab_size = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == num_rows
    assert bitmask.shape[1] * 32 >= vocab_size, "the bitmask covers fewer tokens than the logits"
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [B, W * 4]
    allowed = _byte_bits(logits.device)[as_bytes.long()].view(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill_(~allowed, -math.inf)
