"""The engine core's side of speculative decoding: which sequences propose before a step, whether
the next step may be launched ahead of this one's tokens, and what each verification does to the
sequences' pauses (spec_decode/proposer.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from paged_llm.runner.step_types import LaunchedStep
from paged_llm.sequence import Sequence
from paged_llm.spec_decode.proposer import Proposer, SpeculationPause, can_speculate, wants_speculation

logger = logging.getLogger(__name__)


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, pause_below: float) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.pause_below = pause_below
        self.num_proposer_faults = 0

    def propose(self, running: Iterable[Sequence]) -> None:
        """Proposals for the decoding sequences that may speculate and are not pausing. A proposer
        that fails (a draft model's fault) costs this step its proposals, nothing else."""
        proposing = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not wants_speculation(seq):
                continue
            if SpeculationPause.of(seq, self.pause_below).proposes_now() and can_speculate(seq):
                proposing.append(seq)
        if not proposing:
            return
        try:
            self.proposer.propose(proposing, self.num_speculative_tokens)
        except Exception:
            self.num_proposer_faults += 1
            logger.exception("the proposer failed; this step verifies no proposals")
            for seq in proposing:
                seq.spec_token_ids = []

    def needs_tokens_of(self, launched: LaunchedStep) -> bool:
        """Whether the step after `launched` proposes from its tokens (so it cannot be launched
        before they are on the host): it verified proposals, or a sequence of it is not pausing."""
        if launched.verify_seqs:
            return True
        for seq in launched.seqs:
            if seq.is_finished or not wants_speculation(seq):
                continue
            pause = seq.spec_pause
            if not isinstance(pause, SpeculationPause) or pause.steps_left == 0:
                return True
        return False

    @staticmethod
    def on_verified(spec_token_ids: Mapping[str, list[int]], sequences: Mapping[str, Sequence]) -> None:
        """Each verifying sequence still live: its accepted count moves its pause."""
        for seq_id, emitted in spec_token_ids.items():
            seq = sequences.get(seq_id)
            if seq is not None and isinstance(seq.spec_pause, SpeculationPause):
                seq.spec_pause.on_verified(len(emitted) - 1)
