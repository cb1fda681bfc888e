"""Proposers: before each step the engine core asks one for the next tokens of every sequence that
may speculate (`can_speculate`); it writes them to `seq.spec_token_ids` and the scheduler takes them
into the step (core/scheduler.py), which verifies them (spec_decode/verify.py).

A sequence speculates when the server has a proposer and the request did not turn it off
(`speculative_decoding: false`), and sampling needs nothing that the proposals would have to be
sampled one at a time for: no logprobs, no penalties or bad words (they read the tokens before),
min_tokens already reached (EOS suppression counts positions).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from paged_llm.config import SpeculativeConfig
from paged_llm.sequence import Sequence
from paged_llm.spec_decode.ngram import NgramIndex


def can_speculate(seq: Sequence) -> bool:
    params = seq.sampling_params
    return (
        params.speculative_decoding
        and params.logprobs is None
        and not params.needs_output_history
        and seq.num_output_tokens >= params.min_tokens
        and seq.num_pending_tokens == 0
        and seq.num_tokens - seq.num_computed_tokens == 1
    )


class Proposer(Protocol):
    def propose(self, seqs: Iterable[Sequence], num_speculative_tokens: int) -> None:
        """Sets `seq.spec_token_ids` (up to `num_speculative_tokens`, maybe none) for each of `seqs`."""


class NgramProposer:
    """Prompt lookup in the sequence's own prompt and output (spec_decode/ngram.py), with an index
    per sequence kept in `seq.proposer_state` and extended by the tokens added since."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, seqs: Iterable[Sequence], num_speculative_tokens: int) -> None:
        for seq in seqs:
            index = seq.proposer_state
            if not isinstance(index, NgramIndex):
                index = seq.proposer_state = NgramIndex(self.max_n, self.min_n)
            seq.spec_token_ids = index.propose(seq.all_token_ids, num_speculative_tokens)


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    if not config.enabled:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    raise AssertionError(f"unhandled speculative_method {config.speculative_method!r}")
