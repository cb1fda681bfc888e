"""Repetition, presence and frequency penalties (vLLM semantics), batched on the device.

Token histories are passed as flat indices into the flattened [B, V] logits (row * V + token_id), so a
whole batch's prompts and outputs become one index tensor each, with no padding, and the per-row
counts are built on the device by a single `index_add_` / `index_fill_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_llm.sampling.transfer import host_to_device


@dataclass
class PenaltyMetadata:
    """Per-step penalty inputs for the whole batch; only built when some row has a penalty."""

    repetition_penalties: torch.Tensor  # [B] float32; 1.0 = off; divides positive, multiplies negative logits
    presence_penalties: torch.Tensor  # [B] float32; 0.0 = off; subtracted once per token seen in the output
    frequency_penalties: torch.Tensor  # [B] float32; 0.0 = off; subtracted per occurrence in the output
    prompt_flat_ids: torch.Tensor | None  # [N] int64 row * V + token of prompt tokens; None: no rep. penalty
    output_flat_ids: torch.Tensor  # [M] int64 row * V + token of every generated token (with repeats)
    any_repetition_penalty: bool  # whether the prompt/output "seen" mask is needed at all
    any_presence_penalty: bool  # whether the presence subtraction is needed at all
    any_frequency_penalty: bool  # whether the frequency subtraction is needed at all

    @staticmethod
    def build(
        repetition_penalties: Sequence[float],
        presence_penalties: Sequence[float],
        frequency_penalties: Sequence[float],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> PenaltyMetadata:
        """Host-side construction; rows whose penalty is off contribute no history (it would be unused)."""
        any_repetition = any(penalty != 1.0 for penalty in repetition_penalties)
        output_rows = [
            index
            for index in range(len(output_token_ids))
            if repetition_penalties[index] != 1.0
            or presence_penalties[index] != 0.0
            or frequency_penalties[index] != 0.0
        ]
        prompt_rows = [index for index, penalty in enumerate(repetition_penalties) if penalty != 1.0]
        prompt_flat_ids = (
            host_to_device(flat_token_ids(prompt_rows, prompt_token_ids, vocab_size), device)
            if any_repetition
            else None
        )

        def as_tensor(values: Sequence[float]) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=torch.float32), device)

        return PenaltyMetadata(
            repetition_penalties=as_tensor(repetition_penalties),
            presence_penalties=as_tensor(presence_penalties),
            frequency_penalties=as_tensor(frequency_penalties),
            prompt_flat_ids=prompt_flat_ids,
            output_flat_ids=host_to_device(flat_token_ids(output_rows, output_token_ids, vocab_size), device),
            any_repetition_penalty=any_repetition,
            any_presence_penalty=any(penalty != 0.0 for penalty in presence_penalties),
            any_frequency_penalty=any(penalty != 0.0 for penalty in frequency_penalties),
        )


def flat_token_ids(rows: Sequence[int], token_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """CPU int64 tensor of row * vocab_size + token for the given rows; rejects ids outside the vocabulary.

    Goes through numpy: converting a Python list is ~4x faster there than with torch.as_tensor, and
    numpy arrays / CPU tensors / array('q') are taken without a per-element Python loop.
    """
    parts = [np.asarray(token_ids[row], dtype=np.int64).reshape(-1) for row in rows]
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    tokens = np.concatenate(parts)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        # Checked here because an out-of-range index on the device fails asynchronously, far from the cause.
        raise ValueError(f"token id outside the vocabulary [0, {vocab_size}) in the sampler's inputs")
    row_offsets = np.asarray(rows, dtype=np.int64) * vocab_size
    tokens += np.repeat(row_offsets, [part.size for part in parts])
    return torch.from_numpy(tokens)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> torch.Tensor:
    """Applies all three penalties to float32 [B, V] `logits` in place and returns it.

    Rows with every penalty off are left bit-identical: their factor is 1 and their subtrahend 0.
    """
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=logits.device)
    output_counts.index_add_(
        0,
        penalties.output_flat_ids,
        torch.ones_like(penalties.output_flat_ids, dtype=torch.float32),
    )
    output_counts = output_counts.view(num_rows, vocab_size)
    output_seen = output_counts > 0

    if penalties.any_repetition_penalty:
        seen = torch.zeros(num_rows * vocab_size, dtype=torch.bool, device=logits.device)
        if penalties.prompt_flat_ids is not None:
            seen.index_fill_(0, penalties.prompt_flat_ids, True)
        seen = seen.view(num_rows, vocab_size) | output_seen
        factors = torch.where(seen, penalties.repetition_penalties.unsqueeze(1), 1.0)
        # A penalty > 1 makes a seen token less likely whatever its sign: shrink positives, grow negatives.
        penalized = torch.where(logits > 0, logits / factors, logits * factors)
        logits.copy_(penalized)

    if penalties.any_frequency_penalty:
        logits -= penalties.frequency_penalties.unsqueeze(1) * output_counts
    if penalties.any_presence_penalty:
        logits -= penalties.presence_penalties.unsqueeze(1) * output_seen.to(torch.float32)
    return logits
