"""Counters and latency observations the engine records; serving/metrics.py turns them into metrics.

Written by the engine thread only. Readers take `snapshot()` / `drain_observations()`, which copy
under a lock, so the metrics thread never sees half an update.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_llm.errors import RequestAbortedError

if TYPE_CHECKING:
    from paged_llm.core.scheduler import SchedulerStats
    from paged_llm.request import Request


@dataclass
class LatencyObservations:
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    e2e_latency_s: list[float] = field(default_factory=list)


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


class EngineStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_step_faults = 0
        self.requests_by_outcome: Counter[str] = Counter()
        self._scheduler: SchedulerStats | None = None
        self._observations = LatencyObservations()
        self._last_token_time: dict[str, float] = {}

    def on_request_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.num_prompt_tokens_total += num_prompt_tokens

    def update_scheduler(self, scheduler_stats: SchedulerStats) -> None:
        with self._lock:
            self._scheduler = scheduler_stats

    def on_token(self, request: Request, now: float, is_first_of_request: bool) -> None:
        """One generated token; `is_first_of_request`: the client request's first token (of any of
        its n samples), which is what time-to-first-token measures."""
        with self._lock:
            self.num_generation_tokens_total += 1
            if is_first_of_request:
                self._observations.time_to_first_token_s.append(now - request.arrival_time)
            last = self._last_token_time.get(request.request_id)
            if last is not None:
                self._observations.inter_token_latency_s.append(now - last)
            self._last_token_time[request.request_id] = now
            if request.is_finished:
                self._last_token_time.pop(request.request_id, None)

    def on_request_finished(self, group: Any, now: float, error: BaseException | None) -> None:
        with self._lock:
            for seq in group.sequences:
                self._last_token_time.pop(seq.request.request_id, None)
            if isinstance(error, RequestAbortedError):
                outcome = "abort"
            elif error is not None:
                outcome = "error"
            else:
                reasons = {seq.request.status.value for seq in group.sequences}
                outcome = "abort" if "abort" in reasons else ("stop" if "stop" in reasons else "length")
            self.requests_by_outcome[outcome] += 1
            self._observations.e2e_latency_s.append(now - group.arrival_time)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            sched = self._scheduler
            return StatsSnapshot(
                num_running=sched.num_running if sched else 0,
                num_waiting=sched.num_waiting if sched else 0,
                kv_usage=sched.kv_usage if sched else 0.0,
                prefix_cache_queried_tokens=sched.prefix_cache_queried_tokens if sched else 0,
                prefix_cache_hit_tokens=sched.prefix_cache_hit_tokens if sched else 0,
                num_preemptions_total=sched.num_preemptions_total if sched else 0,
                num_prompt_tokens_total=self.num_prompt_tokens_total,
                num_generation_tokens_total=self.num_generation_tokens_total,
                num_requests_by_outcome=dict(self.requests_by_outcome),
                num_step_faults=self.num_step_faults,
            )

    def drain_observations(self) -> LatencyObservations:
        with self._lock:
            observations, self._observations = self._observations, LatencyObservations()
            return observations
