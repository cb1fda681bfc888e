"""A constrained sequence's grammar matcher, and the token bitmask of a step's constrained rows."""

from __future__ import annotations

from collections.abc import Sequence as Rows
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar

from paged_llm.sequence import GrammarState, Sequence


class SequenceGrammar:
    """The grammar state of one sequence (sequence.GrammarState): advanced with each token the
    sequence takes, terminated once the grammar ended on one of the model's EOS tokens."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self.matcher = xgrammar.GrammarMatcher(compiled)

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
    host, which follows N's copy in stream order).

    `start` fills on a background thread (xgrammar's fill lets go of the GIL), so that a step
    launched ahead has its mask filled while the engine's thread publishes the step before and
    schedules the next one; `finish` waits for it. Filled on the caller's thread instead
    (`fill`), 64 rows of a JSON schema took ~1.9 ms a step on an H100 host, against 3.1 ms of
    forward for Qwen3-0.6B: with the rest of the step's host work, more than the device's time."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        shape = xgrammar.get_bitmask_shape(max_rows, vocab_size)
        self._host = [torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory) for _ in range(2)]
        self._turn = 0
        self._filler: ThreadPoolExecutor | None = None

    def fill(self, seqs: Rows[Sequence]) -> torch.Tensor | None:
        """The [len(seqs), words] int32 bitmask on the device, or None when no row is constrained."""
        host = self._fill_host(self._take_buffer(seqs), [seq.grammar for seq in seqs])
        return None if host is None else self._to_device(host)

    def start(self, seqs: Rows[Sequence]) -> PendingBitmask:
        """Starts filling `seqs`' rows on the background thread. The caller must not advance or
        read these sequences' grammars until `finish` returned."""
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        grammars = [seq.grammar for seq in seqs]
        return PendingBitmask(self._filler.submit(self._fill_host, self._take_buffer(seqs), grammars))

    def finish(self, pending: PendingBitmask) -> torch.Tensor | None:
        """`start`'s bitmask on the device (None: no row constrained); raises what the fill raised."""
        host = pending.future.result()
        return None if host is None else self._to_device(host)

    def close(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None

    def _take_buffer(self, seqs: Rows[Sequence]) -> torch.Tensor:
        host = self._host[self._turn][: len(seqs)]
        self._turn ^= 1
        return host

    @staticmethod
    def _fill_host(host: torch.Tensor, grammars: list[GrammarState | None]) -> torch.Tensor | None:
        """One matcher after another (~2-30 us a row), with no thread pool: xgrammar's batch fill
        (rows spread over a thread per core) cost a constant ~6 ms a step on an H100 host. Each row
        is written whole, so no tensor-wide fill (torch's intra-op thread pool) runs either."""
        if all(grammar is None for grammar in grammars):
            return None
        with torch.inference_mode():  # the buffers may be inference tensors; this thread is not in that mode
            for row, grammar in enumerate(grammars):
                if grammar is None or grammar.is_terminated():  # ended: its row's token is dropped
                    host[row].fill_(-1)
                else:
                    grammar.matcher.fill_next_token_bitmask(host, row)  # type: ignore[union-attr]
        return host

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host  # sampled before the other buffer is filled, and this one again after that
        return host.to(self.device, non_blocking=True)


class PendingBitmask:
    """A bitmask being filled on StepBitmask's background thread."""

    __slots__ = ("future",)

    def __init__(self, future: Future[torch.Tensor | None]) -> None:
        self.future = future
