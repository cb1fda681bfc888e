"""The logprobs the sampler reports for one sampled position, as the host sees them.

Torch-free on purpose: the message to the stub (engine/core_types.py) carries it, and the stub
process unpickles it without importing the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled position (raw model logprobs, before any sampling transform)."""

    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]  # the `logprobs` most likely alternatives, most likely first
    top_logprobs: list[float]
