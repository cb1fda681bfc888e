"""Counters and latency observations of the stub; triton_model/metrics.py turns them into metrics.

Written by whoever processes engine outputs (the output thread); the metrics thread reads
`snapshot()` / `drain_observations()`, which copy under a lock, so it never sees half an update.
Latencies are what a client sees: from the stub's arrival time to the token's processing here.

The core's own figures (scheduler and session stats, step faults, GC pauses, structured output
counters and grammar compile times) arrive with its outputs.
When the core dies (`on_core_lost`) its gauges read 0 until a restarted core reports, and its
running totals are kept as a base that the new core's totals add to, so counters never go back.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, replace

from paged_llm.core.scheduler import SchedulerStats
from paged_llm.core.sessions import SessionStats
from paged_llm.engine.core_types import StructuredOutputStats
from paged_llm.engine.step_times import StepTimes
from paged_llm.gc_pauses import GcPauses


@dataclass
class LatencyObservations:
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    e2e_latency_s: list[float] = field(default_factory=list)
    # per finished request: its prompt tokens, tokens generated (all samples), and n
    request_prompt_tokens: list[int] = field(default_factory=list)
    request_generation_tokens: list[int] = field(default_factory=list)
    request_n: list[int] = field(default_factory=list)
    grammar_compile_s: list[float] = field(default_factory=list)  # the engine core's grammar compiles


@dataclass
class StatsSnapshot:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions_total: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_requests_by_outcome: dict[str, int]
    num_step_faults: int
    engine_gc: GcPauses  # the engine core process's garbage-collection pauses
    engine_steps: StepTimes  # the engine core's busy step periods (engine/step_times.py)
    num_cancellation_checks: int  # is_cancelled() round trips to the server
    cancellation_check_seconds: float  # time they took
    prompt_tokens_computed: int = 0  # prompt tokens whose KV the engine computed (not reused)
    sessions: SessionStats | None = None
    spec_num_drafts: int = 0  # speculative decoding: sequence-steps that verified proposals
    spec_num_draft_tokens: int = 0  # proposed tokens verified
    spec_num_accepted_tokens: int = 0  # of those, accepted
    lora_loads_total: int = 0  # LoRA adapters written into a device slot
    lora_evictions_total: int = 0  # of those, ones that replaced another adapter
    num_lora_slots_used: int = 0  # device slots holding an adapter
    num_requests_by_lora: dict[str, int] = field(default_factory=dict)  # finished requests by adapter
    engine_up: bool = True  # the engine core is serving (False: dead, restarting or given up)
    owns_core: bool = True  # False: a core shared with another stub, which reports its figures
    num_streamed_responses: int = 0  # non-empty streamed responses sent
    num_streamed_response_tokens: int = 0  # the tokens they carried
    num_observations_dropped: int = 0  # past MAX_PENDING_OBSERVATIONS (histograms fell behind)
    # the core's structured output counters (their compile_seconds empty: those go to a histogram)
    structured_output: StructuredOutputStats = field(default_factory=StructuredOutputStats)


_SCHEDULER_TOTALS = (
    "num_preemptions_total",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
    "prompt_tokens_computed",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "lora_loads_total",
    "lora_evictions_total",
)
_SESSION_TOTALS = ("num_evicted_total", "num_expired_total", "num_truncated_total", "reused_tokens_total")
_STRUCTURED_OUTPUT_TOTALS = (
    "num_compiles",
    "num_compile_errors",
    "num_compile_timeouts",
    "num_cache_hits",
    "num_length_in_grammar",
    "num_mask_fills",
    "mask_fill_seconds",
    "mask_wait_seconds",
)


@dataclass(frozen=True)
class _CoreTotals:
    """What earlier engine cores (dead and restarted) counted, added to the live core's totals."""

    scheduler: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)
    num_step_faults: int = 0
    engine_gc: GcPauses = field(default_factory=GcPauses)
    engine_steps: StepTimes = field(default_factory=StepTimes)
    structured_output: StructuredOutputStats = field(default_factory=StructuredOutputStats)


def _plus_gc(base: GcPauses, live: GcPauses) -> GcPauses:
    return GcPauses(
        base.num_collections + live.num_collections,
        base.pause_s_total + live.pause_s_total,
        base.num_long_pauses + live.num_long_pauses,
        max(base.longest_pause_s, live.longest_pause_s),
    )


def _plus_structured_output(
    base: StructuredOutputStats, live: StructuredOutputStats | None
) -> StructuredOutputStats:
    """Totals only: the sum's compile_seconds is empty."""
    if live is None:
        return replace(base, requests_by_kind=dict(base.requests_by_kind), compile_seconds=[])
    kinds = dict(base.requests_by_kind)
    for kind, count in live.requests_by_kind.items():
        kinds[kind] = kinds.get(kind, 0) + count
    return StructuredOutputStats(
        requests_by_kind=kinds,
        **{name: getattr(base, name) + getattr(live, name) for name in _STRUCTURED_OUTPUT_TOTALS},
    )


# Per histogram: observations waiting for the histogram writer. At the cap (the writer has fallen
# ~10 s behind) further ones are dropped and counted, so a stalled server cannot grow the stub.
MAX_PENDING_OBSERVATIONS = 100_000


class EngineStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_step_faults = 0
        self.engine_gc = GcPauses()
        self.engine_steps = StepTimes()
        self.requests_by_outcome: Counter[str] = Counter()
        self.requests_by_lora: Counter[str] = Counter()
        self.scheduler: SchedulerStats | None = None  # as of the last core step seen
        self.sessions: SessionStats | None = None
        self.structured_output: StructuredOutputStats | None = None  # None until a constrained request
        self.num_cancellation_checks = 0
        self.cancellation_check_seconds = 0.0
        self._observations = LatencyObservations()
        self.num_streamed_responses = 0
        self.num_streamed_response_tokens = 0
        self.num_observations_dropped = 0
        self.engine_up = True
        self.owns_core = True
        self._base = _CoreTotals()  # earlier cores' totals

    def on_core_lost(self, counted_its_totals: bool) -> None:
        """The engine core died: its gauges (running, waiting, KV, open sessions) read 0 from now.
        `counted_its_totals`: this stub reported that core's figures (its owner), so they
        become the base the next core's totals add to."""
        with self._lock:
            if counted_its_totals:
                sched, sessions = self.scheduler, self.sessions
                self._base = _CoreTotals(
                    scheduler={
                        name: self._base.scheduler.get(name, 0) + (getattr(sched, name) if sched else 0)
                        for name in _SCHEDULER_TOTALS
                    },
                    sessions={
                        name: self._base.sessions.get(name, 0) + (getattr(sessions, name) if sessions else 0)
                        for name in _SESSION_TOTALS
                    },
                    num_step_faults=self._base.num_step_faults + self.num_step_faults,
                    engine_gc=_plus_gc(self._base.engine_gc, self.engine_gc),
                    engine_steps=self._base.engine_steps.plus(self.engine_steps),
                    structured_output=_plus_structured_output(
                        self._base.structured_output, self.structured_output
                    ),
                )
            self.engine_up = False
            self.scheduler = None
            if self.sessions is not None:
                self.sessions = SessionStats(0, 0, *(0 for _ in _SESSION_TOTALS))
            self.num_step_faults = 0
            self.engine_gc = GcPauses()
            self.engine_steps = StepTimes()
            self.structured_output = None

    def on_core_up(self, owns_core: bool) -> None:
        with self._lock:
            self.engine_up = True
            self.owns_core = owns_core

    def on_prompt_processed(self, num_prompt_tokens: int) -> None:
        """A request's prefill finished (its first token came)."""
        with self._lock:
            self.num_prompt_tokens_total += num_prompt_tokens

    def update_scheduler(
        self,
        scheduler_stats: SchedulerStats,
        num_step_faults: int,
        engine_gc: GcPauses | None = None,
        session_stats: SessionStats | None = None,
        engine_steps: StepTimes | None = None,
    ) -> None:
        with self._lock:
            self.scheduler = scheduler_stats
            if session_stats is not None:
                self.sessions = session_stats
            self.num_step_faults = num_step_faults
            if engine_gc is not None:
                self.engine_gc = engine_gc
            if engine_steps is not None:
                self.engine_steps = engine_steps

    def update_structured_output(self, stats: StructuredOutputStats) -> None:
        """The core's structured output counters (totals since it started) and the grammar compile
        times since its previous report (each becomes a histogram observation)."""
        with self._lock:
            self.structured_output = stats
            for seconds in stats.compile_seconds:
                self._observe(self._observations.grammar_compile_s, seconds)

    def on_token(
        self, time_to_first_token_s: float | None, last_token_time: float | None, now: float
    ) -> None:
        """One generated token of a sequence; `time_to_first_token_s` is set for the client request's
        first token (of any of its n samples), `last_token_time` is the sequence's previous token."""
        with self._lock:
            self.num_generation_tokens_total += 1
            if time_to_first_token_s is not None:
                self._observe(self._observations.time_to_first_token_s, time_to_first_token_s)
            if last_token_time is not None:
                self._observe(self._observations.inter_token_latency_s, now - last_token_time)

    def _observe(self, pending: list, value: float) -> None:
        if len(pending) < MAX_PENDING_OBSERVATIONS:
            pending.append(value)
        else:
            self.num_observations_dropped += 1

    def on_request_finished(
        self,
        outcome: str,
        e2e_latency_s: float,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
        n: int = 1,
        lora_name: str | None = None,
    ) -> None:
        """`outcome`: stop, length, abort or error; `lora_name`: its LoRA adapter, if any."""
        with self._lock:
            self.requests_by_outcome[outcome] += 1
            if lora_name is not None:
                self.requests_by_lora[lora_name] += 1
            observations = self._observations
            self._observe(observations.e2e_latency_s, e2e_latency_s)
            self._observe(observations.request_prompt_tokens, num_prompt_tokens)
            self._observe(observations.request_generation_tokens, num_generation_tokens)
            self._observe(observations.request_n, n)

    def on_cancellation_poll(self, num_checks: int, seconds: float) -> None:
        with self._lock:
            self.num_cancellation_checks += num_checks
            self.cancellation_check_seconds += seconds

    def on_streamed_response(self, num_tokens: int) -> None:
        with self._lock:
            self.num_streamed_responses += 1
            self.num_streamed_response_tokens += num_tokens

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            base = self._base
            sched = self.scheduler
            if sched is not None and base.scheduler:
                sched = replace(
                    sched, **{n: getattr(sched, n) + base.scheduler[n] for n in _SCHEDULER_TOTALS}
                )
            sessions = self.sessions
            if sessions is not None and base.sessions:
                sessions = replace(
                    sessions, **{n: getattr(sessions, n) + base.sessions[n] for n in _SESSION_TOTALS}
                )

            def total(name: str) -> int:  # a scheduler total, with no live core's stats (yet)
                return getattr(sched, name) if sched else base.scheduler.get(name, 0)

            return StatsSnapshot(
                num_running=sched.num_running if sched else 0,
                num_waiting=sched.num_waiting if sched else 0,
                kv_usage=sched.kv_usage if sched else 0.0,
                prefix_cache_queried_tokens=total("prefix_cache_queried_tokens"),
                prefix_cache_hit_tokens=total("prefix_cache_hit_tokens"),
                num_preemptions_total=total("num_preemptions_total"),
                num_prompt_tokens_total=self.num_prompt_tokens_total,
                num_generation_tokens_total=self.num_generation_tokens_total,
                num_requests_by_outcome=dict(self.requests_by_outcome),
                num_step_faults=base.num_step_faults + self.num_step_faults,
                engine_gc=_plus_gc(base.engine_gc, self.engine_gc),
                engine_steps=base.engine_steps.plus(self.engine_steps),
                num_cancellation_checks=self.num_cancellation_checks,
                cancellation_check_seconds=self.cancellation_check_seconds,
                prompt_tokens_computed=total("prompt_tokens_computed"),
                sessions=sessions,
                spec_num_drafts=total("spec_num_drafts"),
                spec_num_draft_tokens=total("spec_num_draft_tokens"),
                spec_num_accepted_tokens=total("spec_num_accepted_tokens"),
                lora_loads_total=total("lora_loads_total"),
                lora_evictions_total=total("lora_evictions_total"),
                num_lora_slots_used=sched.num_lora_slots_used if sched else 0,
                num_requests_by_lora=dict(self.requests_by_lora),
                engine_up=self.engine_up,
                owns_core=self.owns_core,
                num_streamed_responses=self.num_streamed_responses,
                num_streamed_response_tokens=self.num_streamed_response_tokens,
                num_observations_dropped=self.num_observations_dropped,
                structured_output=_plus_structured_output(base.structured_output, self.structured_output),
            )

    def drain_observations(self) -> LatencyObservations:
        with self._lock:
            observations, self._observations = self._observations, LatencyObservations()
            return observations

    def num_pending_observations(self) -> int:
        """Observations recorded and not yet drained (all histograms)."""
        with self._lock:
            return sum(len(values) for values in vars(self._observations).values())
