"""Proposers: before each step the engine core asks one for the next tokens of every sequence that
may speculate (`can_speculate`); it writes them to `seq.spec_token_ids` and the scheduler takes them
into the step (core/scheduler.py), which verifies them (sampling/verify.py).

A sequence speculates when the server has a proposer and the request did not turn it off
(`speculative_decoding: false`), and sampling needs nothing that the proposals would have to be
sampled one at a time for: no logprobs, no penalties or bad words (they read the tokens before),
min_tokens already reached (EOS suppression counts positions), no grammar (structured output: a
proposal would need the grammar's mask at each of its positions; those rows decode one token a step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from paged_llm.config import SpeculativeConfig
from paged_llm.sequence import Sequence
from paged_llm.spec_decode.ngram import NgramIndex


def wants_speculation(seq: Sequence) -> bool:
    """The request allows proposals and samples nothing that needs them one at a time."""
    params = seq.sampling_params
    return (
        params.speculative_decoding
        and params.logprobs is None
        and not params.needs_output_history
        and seq.num_output_tokens >= params.min_tokens
        and seq.grammar is None
    )


def can_speculate(seq: Sequence) -> bool:
    """It may propose now: it decodes, and its last token is on the host."""
    return (
        seq.num_pending_tokens == 0
        and seq.num_tokens - seq.num_computed_tokens == 1
        and wants_speculation(seq)
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


class SpeculationPause:
    """One sequence's pause in proposing while speculation does not pay for it. A verifying step in
    which it accepted fewer than `pause_below` proposals pauses it for 1 step, then (if its next
    verification does no better) 2, 4, ... up to MAX_PAUSE_STEPS; a verification that pays ends the
    doubling. It is the sequence's own state (its own acceptances), so whether a step proposes for
    it, and so a sampled request's tokens, do not depend on the other requests of the batch. When
    no sequence of a step will propose at the next one, that step may be launched ahead of this
    one's tokens (asynchronous scheduling): speculation that is never accepted then costs about one
    verifying step in MAX_PAUSE_STEPS + 1."""

    MAX_PAUSE_STEPS = 64

    def __init__(self, pause_below: float) -> None:
        self.pause_below = pause_below
        self.steps_left = 0  # decoding steps that do not propose
        self.length = 0  # the last pause's length (0: its last verification paid)

    @staticmethod
    def of(seq: Sequence, pause_below: float) -> SpeculationPause:
        pause = seq.spec_pause
        if not isinstance(pause, SpeculationPause):
            pause = seq.spec_pause = SpeculationPause(pause_below)
        return pause

    def proposes_now(self) -> bool:
        """Called once per decoding step of the sequence, before it is scheduled."""
        if self.steps_left > 0:
            self.steps_left -= 1
            return False
        return True

    def on_verified(self, num_accepted: int) -> None:
        if num_accepted >= self.pause_below:
            self.length = 0
            return
        self.length = min(max(1, 2 * self.length), self.MAX_PAUSE_STEPS)
        self.steps_left = self.length


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    if not config.enabled:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    return None  # draft_model: the engine core builds it (spec_decode/draft_model.py), it owns a runner
