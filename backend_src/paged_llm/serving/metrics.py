"""Engine statistics -> Prometheus metric families on Triton's /metrics endpoint.

Triton's Python backend exposes custom metrics through `pb_utils.MetricFamily`; model.py passes the
`pb_utils` module in, so this module has no import-time dependency on Triton. `update()` runs on the
response thread every ~0.5 s: gauges are set, counters advanced by what changed since the previous
update, and latency observations drained into histograms.

| metric | kind | meaning |
|---|---|---|
| paged_llm_num_requests_running | gauge | sequences in the running batch |
| paged_llm_num_requests_waiting | gauge | sequences waiting (queued or preempted) |
| paged_llm_kv_cache_usage_ratio | gauge | fraction of KV blocks held by requests (0..1) |
| paged_llm_prefix_cache_queries_total | counter | prompt tokens looked up in the prefix cache |
| paged_llm_prefix_cache_hits_total | counter | prompt tokens served from the prefix cache |
| paged_llm_prefix_cache_hit_ratio | gauge | hits / queries since start |
| paged_llm_num_preemptions_total | counter | preemptions by recompute |
| paged_llm_prompt_tokens_total | counter | prompt tokens of accepted requests |
| paged_llm_generation_tokens_total | counter | generated tokens |
| paged_llm_request_outcomes_total{outcome} | counter | finished requests: stop, length, abort, error |
| paged_llm_final_responses_total{code} | counter | FINAL responses sent, by status code |
| paged_llm_time_to_first_token_seconds | histogram | arrival -> first generated token |
| paged_llm_inter_token_latency_seconds | histogram | time between tokens of a sequence |
| paged_llm_e2e_request_latency_seconds | histogram | arrival -> request finished |
"""

from __future__ import annotations

import threading
from typing import Any

from paged_llm.engine.stats import EngineStats

_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
]
_ITL_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
]
_E2E_BUCKETS = [
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
]
OUTCOMES = ("stop", "length", "abort", "error")
FINAL_CODES = ("success", "cancelled", "invalid_arg", "unavailable", "internal")


class TritonMetrics:
    def __init__(self, pb_utils: Any, stats: EngineStats, model_name: str, model_version: str) -> None:
        self._stats = stats
        self._lock = threading.Lock()
        labels = {"model": model_name, "version": model_version}
        family = pb_utils.MetricFamily
        self._families: list[Any] = []

        def metric(
            name: str, description: str, kind: Any, extra: dict[str, str] | None = None, **kw: Any
        ) -> Any:
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels={**labels, **(extra or {})}, **kw)

        def per_label(name: str, description: str, label: str, values: tuple[str, ...]) -> dict[str, Any]:
            fam = family(name=name, description=description, kind=family.COUNTER)
            self._families.append(fam)
            return {v: fam.Metric(labels={**labels, label: v}) for v in values}

        self._running = metric(
            "paged_llm_num_requests_running", "Sequences in the running batch", family.GAUGE
        )
        self._waiting = metric("paged_llm_num_requests_waiting", "Sequences waiting to run", family.GAUGE)
        self._kv_usage = metric(
            "paged_llm_kv_cache_usage_ratio", "Fraction of KV blocks in use", family.GAUGE
        )
        self._prefix_queries = metric(
            "paged_llm_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache",
            family.COUNTER,
        )
        self._prefix_hits = metric(
            "paged_llm_prefix_cache_hits_total", "Prompt tokens served by the prefix cache", family.COUNTER
        )
        self._prefix_ratio = metric(
            "paged_llm_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens", family.GAUGE
        )
        self._preemptions = metric(
            "paged_llm_num_preemptions_total", "Preemptions by recompute", family.COUNTER
        )
        self._prompt_tokens = metric(
            "paged_llm_prompt_tokens_total", "Prompt tokens accepted", family.COUNTER
        )
        self._generation_tokens = metric(
            "paged_llm_generation_tokens_total", "Tokens generated", family.COUNTER
        )
        self._outcomes = per_label(
            "paged_llm_request_outcomes_total", "Finished requests by outcome", "outcome", OUTCOMES
        )
        self._finals = per_label(
            "paged_llm_final_responses_total", "FINAL responses sent, by status", "code", FINAL_CODES
        )
        histogram = family.HISTOGRAM
        self._ttft = metric(
            "paged_llm_time_to_first_token_seconds", "Time to first token", histogram, buckets=_TTFT_BUCKETS
        )
        self._itl = metric(
            "paged_llm_inter_token_latency_seconds", "Time between tokens", histogram, buckets=_ITL_BUCKETS
        )
        self._e2e = metric(
            "paged_llm_e2e_request_latency_seconds", "Request latency", histogram, buckets=_E2E_BUCKETS
        )
        self._last: dict[str, float] = {}

    def count_final(self, code: str) -> None:
        self._finals[code].increment(1)

    def update(self) -> None:
        with self._lock:
            snapshot = self._stats.snapshot()
            self._running.set(snapshot.num_running)
            self._waiting.set(snapshot.num_waiting)
            self._kv_usage.set(snapshot.kv_usage)
            queried, hits = snapshot.prefix_cache_queried_tokens, snapshot.prefix_cache_hit_tokens
            self._prefix_ratio.set(hits / queried if queried else 0.0)
            self._advance("prefix_queries", self._prefix_queries, queried)
            self._advance("prefix_hits", self._prefix_hits, hits)
            self._advance("preemptions", self._preemptions, snapshot.num_preemptions_total)
            self._advance("prompt_tokens", self._prompt_tokens, snapshot.num_prompt_tokens_total)
            self._advance("generation_tokens", self._generation_tokens, snapshot.num_generation_tokens_total)
            for outcome, counter in self._outcomes.items():
                self._advance(f"outcome:{outcome}", counter, snapshot.num_requests_by_outcome.get(outcome, 0))
            observations = self._stats.drain_observations()
            for value in observations.time_to_first_token_s:
                self._ttft.observe(value)
            for value in observations.inter_token_latency_s:
                self._itl.observe(value)
            for value in observations.e2e_latency_s:
                self._e2e.observe(value)

    def _advance(self, key: str, counter: Any, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.increment(delta)
            self._last[key] = total
