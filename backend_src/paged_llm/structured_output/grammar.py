"""A constrained sequence's grammar matcher, and the token bitmask of a step's constrained rows."""

from __future__ import annotations

from collections.abc import Sequence as Rows

import torch
import xgrammar

from paged_llm.sequence import Sequence

# Rows filled one matcher at a time below this; xgrammar's batch fill (a thread per row group) above.
_BATCH_FILL_MIN_ROWS = 8


class SequenceGrammar:
    """The grammar state of one sequence (sequence.GrammarState): advanced with each token the
    sequence takes, terminated once the grammar ended on one of the model's EOS tokens."""

    __slots__ = ("kind", "matcher")

    def __init__(self, compiled: xgrammar.CompiledGrammar, kind: str) -> None:
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.kind = kind  # json, regex, ...: for metrics

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def can_end(self) -> bool:
        """The text so far is a complete sentence of the grammar: an EOS token is allowed now."""
        return self.matcher.is_completed()


class StepBitmask:
    """Fills the bitmask of one step's sampled rows on the host (bit t of row r: token t allowed)
    and hands it to the sampler on the device. Rows without a grammar allow everything.

    On an accelerator two pinned host buffers alternate: the copy of step N's mask may still be in
    flight while step N+1's is filled (step N+2 is filled only after step N+1's tokens reached the
    host, which follows N's copy in stream order)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, pin_memory: bool) -> None:
        self.vocab_size = vocab_size
        self.device = device
        shape = xgrammar.get_bitmask_shape(max_rows, vocab_size)
        self._host = [torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory) for _ in range(2)]
        self._turn = 0
        self._batch = xgrammar.BatchGrammarMatcher()

    def fill(self, seqs: Rows[Sequence]) -> torch.Tensor | None:
        """The [len(seqs), words] int32 bitmask on the device, or None when no row is constrained."""
        grammars = [seq.grammar for seq in seqs]
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return None
        host = self._host[self._turn][: len(seqs)]
        self._turn ^= 1
        host.fill_(-1)
        live = [row for row in rows if not grammars[row].is_terminated()]  # type: ignore[union-attr]
        # A terminated grammar's sequence has ended (its row's token is dropped): it allows all.
        if len(live) >= _BATCH_FILL_MIN_ROWS:
            matchers = [grammars[row].matcher for row in live]  # type: ignore[union-attr]
            self._batch.batch_fill_next_token_bitmask(matchers, host, live)
        else:
            for row in live:
                grammars[row].matcher.fill_next_token_bitmask(host, row)  # type: ignore[union-attr]
        if self.device.type == "cpu":
            return host  # sampled before the other buffer is filled, and this one again after that
        return host.to(self.device, non_blocking=True)
