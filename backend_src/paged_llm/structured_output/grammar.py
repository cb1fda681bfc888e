"""A constrained sequence's grammar matcher, and the token bitmask of a step's constrained rows."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence as Rows
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar

from paged_llm.sequence import GrammarTokens, Sequence

logger = logging.getLogger(__name__)


class SequenceGrammar:
    """The grammar state of one sequence (sequence.GrammarState): advanced with each token the
    sequence takes, terminated once the grammar ended on one of the model's EOS tokens."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self.matcher = xgrammar.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @staticmethod
    def accept_tokens(grammars: list[SequenceGrammar], token_ids: list[int]) -> list[bool]:
        # One xgrammar call for a step's rows: a call a row cost ~4.5 us of the engine thread's
        # time on an H100 host (a c64 step's update went from 0.25 to 0.54 ms).
        matchers = [grammar.matcher for grammar in grammars]
        return xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, token_ids)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def can_end(self) -> bool:
        """The text so far is a complete sentence of the grammar: an EOS token is allowed now."""
        return self.matcher.is_completed()


def usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


# The rows go to xgrammar in one call from one fill thread, over at most this many of xgrammar's
# own threads (a thread per 4 cores, up to 4), at least MIN_ROWS_PER_THREAD rows a thread; one on
# small hosts, where a second would take the core the engine's own thread runs on.
# - Splitting the rows over several Python fill threads instead (one call each) made each of them
#   wait for the GIL to enter its call while the engine's thread ran Python: on a 16-core H100 host,
#   64 rows of bench_structured's schema over 4 fill threads left finish() waiting 0.104 ms p50 after
#   1.5 ms of Python, against 0.003 ms for one call over 4 xgrammar threads, whose fill took
#   0.556 ms against 0.898 ms on 1 thread (scripts/bench_bitmask_overlap.py --threads).
# - Not one xgrammar thread per core: with 16 (aae627d) a served c64 step cost a constant ~6 ms more
#   on an H100 host, where the server, its stubs and the clients share the cores.
MAX_XGRAMMAR_THREADS = max(1, min(4, usable_cores() // 4))
MIN_ROWS_PER_THREAD = 16
# start() fills this few rows on the calling thread: handing them to the fill thread cost more than
# their fill (batch 1 on an H100 host: the core waited 0.165 ms a step for a 0.091 ms fill, with
# little of its own work to do meanwhile).
MAX_INLINE_FILL_ROWS = 2
# A fill thread needs the GIL for a moment to enter xgrammar's calls and to leave them (three times
# a job: start, between the accept and the fill, end). With Python's default switch interval (5 ms)
# it waits until the core's thread lets go (blocks, or 5 ms pass), so the fill ran after the core's
# publish and schedule instead of under them (scripts/bench_bitmask_overlap.py). At 0.2 ms a job that
# also took the step's tokens still left finish() waiting ~1.4 ms behind 2 ms of the core's Python
# (64 rows, `--accept`, a 2-core CPU machine), at 0.05 ms ~0.3 ms (its own work; a fill alone 0.02 ms
# either way). The process's interval is lowered to this once the fill thread starts; only a thread
# waiting for the GIL makes the holder switch, so the engine's thread pays nothing while none waits.
FILL_SWITCH_INTERVAL_S = 0.00005


@dataclass
class BitmaskTimes:
    """Totals since start: the steps' mask fills (on whichever thread filled; with the grammars'
    taking of the step before's tokens where the fill thread did that first) and how long the
    engine's thread waited for a fill it had started on the fill thread."""

    num_fills: int = 0
    fill_seconds: float = 0.0
    wait_seconds: float = 0.0


class StepBitmask:
    """Fills the bitmask of one step's sampled rows on the host (bit t of row r: token t allowed)
    and hands it to the sampler on the device. Rows without a grammar allow everything.

    On an accelerator two pinned host buffers alternate: the copy of step N's mask may still be in
    flight while step N+1's is filled (step N+2 is filled only after step N+1's tokens reached the
    host, which follows N's copy in stream order).

    The rows are filled by one call of xgrammar's batch fill, which lets go of the GIL for all of
    them (a Python loop over the rows takes the GIL back after each one, and on a thread beside the
    engine's busy thread each take can wait) and spreads them over xgrammar's own threads
    (`max_threads`: MAX_XGRAMMAR_THREADS unless configured). `start` makes that call on a fill
    thread, so that a step launched ahead has its mask filled while the engine's thread publishes
    the step before and schedules the next one (a row or two it fills at once:
    MAX_INLINE_FILL_ROWS); `finish` waits for it."""

    def __init__(
        self,
        max_rows: int,
        vocab_size: int,
        device: torch.device,
        pin_memory: bool,
        max_threads: int = MAX_XGRAMMAR_THREADS,
    ) -> None:
        self.device = device
        self.max_threads = max_threads
        shape = xgrammar.get_bitmask_shape(max_rows, vocab_size)
        self._host = [torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory) for _ in range(2)]
        # numpy views of the same memory, for setting the unconstrained rows: one numpy assignment on
        # this thread (a torch op over many rows runs on torch's intra-op threads, which then spin
        # on every core; a torch op a row costs ~4 us of host time each)
        self._host_arrays = [buffer.numpy() for buffer in self._host]
        self._turn = 0
        # CUDA: the mask goes up on a copy stream of its own into one of two device buffers, so the
        # copy (1.2 MB for 64 rows of a 152k vocabulary) runs beside the step's forward instead of
        # between the forward and the sampling; _released[b]: buffer b's last reader has run
        self._copy_stream: torch.cuda.Stream | None = None
        self._device_buffers: list[torch.Tensor] = []
        self._released: list[torch.cuda.Event | None] = [None, None]
        self._reader_pending = [False, False]
        self._filler: ThreadPoolExecutor | None = None
        # xgrammar BatchGrammarMatchers by max_threads, one set per calling thread
        self._batch_matchers = threading.local()
        self.times = BitmaskTimes()

    def fill(self, seqs: Rows[Sequence]) -> torch.Tensor | None:
        """The [len(seqs), words] int32 bitmask on the device, or None when no row is constrained."""
        plan = self._plan(seqs)
        if plan is None:
            return None
        host, rows = plan
        self._take_and_fill(host, rows, None)
        return self._to_device(host)

    def start(self, seqs: Rows[Sequence], grammar_tokens: GrammarTokens | None = None) -> PendingBitmask:
        """Starts filling `seqs`' rows on the fill thread, after their grammars took
        `grammar_tokens` (the step before's tokens, which the engine's thread left to this job);
        a row or two: does it all now, and raises what that raised. The caller must not advance or
        read these sequences' grammars (nor those in `grammar_tokens`) until `finish` returned."""
        plan = self._plan(seqs, grammar_tokens)
        host, rows = plan if plan is not None else (None, [])
        if len(rows) <= MAX_INLINE_FILL_ROWS and len(grammar_tokens or ()) <= MAX_INLINE_FILL_ROWS:
            self._take_and_fill(host, rows, grammar_tokens)  # little to do: not worth a hand-off
            return PendingBitmask(host, None)
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
            if sys.getswitchinterval() > FILL_SWITCH_INTERVAL_S:
                logger.info(
                    "bitmask fill thread: the GIL switch interval goes from %.1f to %.1f ms",
                    sys.getswitchinterval() * 1e3,
                    FILL_SWITCH_INTERVAL_S * 1e3,
                )
                sys.setswitchinterval(FILL_SWITCH_INTERVAL_S)
        return PendingBitmask(host, self._filler.submit(self._take_and_fill, host, rows, grammar_tokens))

    def finish(self, pending: PendingBitmask) -> torch.Tensor | None:
        """`start`'s bitmask on the device (None: no row constrained); raises what a fill raised."""
        if pending.future is not None:
            waited_from = time.perf_counter()
            try:
                pending.future.result()
            finally:
                self.times.wait_seconds += time.perf_counter() - waited_from
        return None if pending.host is None else self._to_device(pending.host)

    def close(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None

    def _plan(
        self, seqs: Rows[Sequence], grammar_tokens: GrammarTokens | None = None
    ) -> tuple[torch.Tensor, list[tuple[int, object]]] | None:
        """The host buffer for this step, with the rows that allow everything already set, and the
        (row, matcher) pairs left to fill; None when no row has a grammar. A sequence that ended
        (its row's token is dropped) needs no mask, nor does one whose grammar ends on the token
        `grammar_tokens` gives it (it has not taken it yet: is_terminated cannot tell)."""
        grammars = [seq.grammar for seq in seqs]
        if all(grammar is None for grammar in grammars):
            return None
        ending = set()
        if grammar_tokens is not None:
            ending = {
                id(g) for g, ends in zip(grammar_tokens.grammars, grammar_tokens.ending, strict=True) if ends
            }
        host = self._host[self._turn][: len(seqs)]
        host_array = self._host_arrays[self._turn]
        self._turn ^= 1
        rows: list[tuple[int, object]] = []
        free_rows: list[int] = []
        for row, (seq, grammar) in enumerate(zip(seqs, grammars, strict=True)):
            if grammar is None or seq.is_finished or id(grammar) in ending or grammar.is_terminated():
                free_rows.append(row)
            else:
                rows.append((row, grammar.matcher))  # type: ignore[attr-defined]
        if free_rows:
            host_array[free_rows] = -1
        return host, rows

    def _take_and_fill(
        self, host: torch.Tensor | None, rows: list[tuple[int, object]], grammar_tokens: GrammarTokens | None
    ) -> None:
        if not rows and not grammar_tokens:
            return
        started = time.perf_counter()
        try:
            if grammar_tokens:
                grammar_tokens.take_all()
            if rows:
                assert host is not None
                self._fill_with_xgrammar(host, rows)
        finally:
            # one writer at a time: the fill thread, or the engine's thread while none is pending
            self.times.num_fills += 1
            self.times.fill_seconds += time.perf_counter() - started

    def _fill_with_xgrammar(self, host: torch.Tensor, rows: list[tuple[int, object]]) -> None:
        num_threads = max(1, min(self.max_threads, len(rows) // MIN_ROWS_PER_THREAD))
        matchers = getattr(self._batch_matchers, "by_threads", None)
        if matchers is None:
            matchers = self._batch_matchers.by_threads = {}
        batch = matchers.get(num_threads)
        if batch is None:
            batch = matchers[num_threads] = xgrammar.BatchGrammarMatcher(num_threads)
        # The buffers may be inference tensors, and a fill thread is not in that mode.
        with torch.inference_mode():
            batch.batch_fill_next_token_bitmask([m for _, m in rows], host, [r for r, _ in rows])

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host  # sampled before the other buffer is filled, and this one again after that
        if self.device.type != "cuda":
            return host.to(self.device, non_blocking=True)
        return self._to_cuda(host)

    def _to_cuda(self, host: torch.Tensor) -> torch.Tensor:
        """Copies `host` (a view of host buffer b) into device buffer b on the copy stream; the
        current stream waits for the copy. Every call's reader (the sampling) is enqueued before the
        next call, so the next call for the other buffer can mark b's reader done (_released[b]);
        in the engine's order that has long run when b is copied again (its tokens are on the host)."""
        turn = 0 if host.data_ptr() == self._host[0].data_ptr() else 1
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._device_buffers = [torch.empty_like(buffer, device=self.device) for buffer in self._host]
        main = torch.cuda.current_stream(self.device)
        released = self._released[turn]
        if self._reader_pending[turn]:  # b twice in a row: wait for everything on the stream
            released = torch.cuda.Event()
            released.record(main)
        if released is not None:
            self._copy_stream.wait_event(released)
        target = self._device_buffers[turn][: host.shape[0]]
        with torch.cuda.stream(self._copy_stream):
            target.copy_(host, non_blocking=True)
        main.wait_stream(self._copy_stream)
        other = turn ^ 1
        if self._reader_pending[other]:
            self._released[other] = torch.cuda.Event()
            self._released[other].record(main)
            self._reader_pending[other] = False
        self._released[turn], self._reader_pending[turn] = None, True
        return target


class PendingBitmask:
    """A bitmask being filled on StepBitmask's fill thread (host None: no row constrained; future
    None: nothing to fill)."""

    __slots__ = ("future", "host")

    def __init__(self, host: torch.Tensor | None, future: Future[None] | None) -> None:
        self.host = host
        self.future = future
