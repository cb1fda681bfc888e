"""The engine core's side of structured output: gives a constrained request's sequences their
grammar matchers, or parks the request until its grammar is compiled (the compiler works off the
step loop, on its threads or in worker processes: structured_output/compiler.py), and keeps the
counters.

A parked request is in the request table (an abort or its deadline ends it as usual) but none of
its sequences is in the scheduler: the other requests keep stepping. Requests that wait for the
same grammar share one compile.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from paged_llm.config import StructuredOutputConfig
from paged_llm.engine.core_types import CoreError, EngineCoreInfo, StructuredOutputStats
from paged_llm.engine.engine_core.request_table import CoreRequest
from paged_llm.sequence import Sequence, SequenceStatus
from paged_llm.structured_output.compiler import GrammarCompiler, GrammarKey
from paged_llm.structured_output.grammar import BitmaskTimes, SequenceGrammar
from paged_llm.structured_output.tokenizer_info import build_tokenizer_info
from paged_llm.structured_output_params import FIELD, StructuredOutputParams


@dataclass
class ReadyRequest:
    """A parked request whose grammar compile ended: start it, or fail it with `error`."""

    record: CoreRequest
    sequences: list[Sequence]
    error: CoreError | None


class StructuredOutputs:
    """`wake`: called from a compiler thread when a compile ended (the busy loop's inbox wake-up)."""

    def __init__(
        self, config: StructuredOutputConfig, info: EngineCoreInfo, wake: Callable[[], None]
    ) -> None:
        self.config = config
        self.info = info
        self.wake = wake
        self._compiler: GrammarCompiler | None = None
        self._parked: dict[GrammarKey, list[tuple[CoreRequest, list[Sequence]]]] = {}
        self._stats = StructuredOutputStats()

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # the first constrained request: workers start now, not at boot
            info = self.info
            self._compiler = GrammarCompiler(
                lambda: build_tokenizer_info(info.model_dir, info.vocab_size, info.eos_token_ids),
                num_workers=self.config.grammar_compile_workers,
                timeout_s=self.config.grammar_compile_timeout_s,
                cache_entries=self.config.grammar_cache_entries,
                on_done=lambda: self.wake(),
                inprocess_max_bytes=self.config.grammar_inprocess_max_bytes,
                compile_threads=self.config.grammar_compile_threads,
            )
        return self._compiler

    def key(self, params: StructuredOutputParams) -> GrammarKey:
        any_whitespace = params.any_whitespace
        if any_whitespace is None:
            any_whitespace = self.config.structured_output_whitespace == "any"
        return (params.kind, params.spec, any_whitespace)

    def attach_or_park(
        self, record: CoreRequest, sequences: list[Sequence], params: StructuredOutputParams
    ) -> bool:
        """True: the grammar was compiled already and each sequence has its matcher; False: the
        request is parked until its compile ends (take_ready)."""
        kinds = self._stats.requests_by_kind
        kinds[params.kind] = kinds.get(params.kind, 0) + 1
        key = self.key(params)
        compiled = self.compiler.cached(key)
        if compiled is not None:
            self._stats.num_cache_hits += 1
            _attach(sequences, compiled)
            return True
        waiting = self._parked.setdefault(key, [])
        waiting.append((record, sequences))
        if len(waiting) == 1:
            self.compiler.submit(key)
        return False

    @property
    def num_parked(self) -> int:
        return sum(len(waiting) for waiting in self._parked.values())

    def take_ready(self) -> list[ReadyRequest]:
        """The parked requests whose compile ended since the last call."""
        if self._compiler is None or not self._parked:
            return []
        ready = []
        for result in self._compiler.take_results():
            self._stats.compile_seconds.append(result.seconds)
            kind = result.key[0]
            error = None
            if result.grammar is not None:
                self._stats.num_compiles += 1
            else:
                self._stats.num_compile_errors += 1
                self._stats.num_compile_timeouts += int(result.timed_out)
                field = result.error_field or f"{FIELD}.{kind}"
                error = CoreError("invalid_arg", result.error or "the grammar did not compile", field)
            for record, sequences in self._parked.pop(result.key, []):
                if result.grammar is not None:
                    _attach(sequences, result.grammar)
                ready.append(ReadyRequest(record, sequences, error))
        return ready

    def wait(self, timeout_s: float) -> None:
        """Blocks until a parked request's compile ended (or `timeout_s`): for callers that step the
        core themselves and have nothing else to step."""
        if self._compiler is not None and self._parked:
            self._compiler.wait_for_results(timeout_s)

    def on_finished(self, seq: Sequence) -> None:
        """A sequence ended: count a grammar cut short by the length limit. (Its grammar had not
        ended: an ended grammar ends its sequence with `stop`. Not asked: the bitmask's fill thread
        may be advancing it.)"""
        if seq.grammar is not None and seq.status is SequenceStatus.FINISHED_LENGTH:
            self._stats.num_length_in_grammar += 1

    def take_stats(self, mask_times: BitmaskTimes | None = None) -> StructuredOutputStats | None:
        """The counters (None while no constrained request came); compile times since the last call.
        `mask_times`: the runner's bitmask fill totals (None before its first constrained step)."""
        if self._compiler is None:
            return None
        stats = copy.copy(self._stats)
        stats.requests_by_kind = dict(self._stats.requests_by_kind)
        if mask_times is not None:
            stats.num_mask_fills = mask_times.num_fills
            stats.mask_fill_seconds = mask_times.fill_seconds
            stats.mask_wait_seconds = mask_times.wait_seconds
        self._stats.compile_seconds = []
        return stats

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def _attach(sequences: list[Sequence], compiled: object) -> None:
    for seq in sequences:
        seq.grammar = SequenceGrammar(compiled)  # type: ignore[arg-type]
