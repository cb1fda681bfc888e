"""Engine statistics -> Prometheus metrics on Triton's /metrics endpoint.

Triton's Python backend exposes custom metrics through `pb_utils.MetricFamily`; model.py passes the
`pb_utils` module in, so this module has no import-time dependency on Triton. `update()` runs on the
housekeeping thread every ~0.5 s and costs a bounded number of calls whatever the load, because every
metric operation of the Python backend is a round trip to the server process (measured on a 2-core
machine: 25-45 us each, on the same channel as the responses):

* counters advance by what changed since the previous update;
* gauges move by `increment(delta)`: `set()` holds the GIL while it waits for the server (Triton
  2.51), `increment` releases it;
* histograms are kept here and exported in Prometheus' histogram layout as counter series,
  `<name>_bucket{le=...}` (cumulative), `<name>_sum` and `<name>_count`, so `histogram_quantile()`
  works on them, at a cost per update of one call per bucket that changed, not one per observation
  (per-token latencies would otherwise add tens of thousands of round trips per second).

| metric | kind | meaning |
|---|---|---|
| paged_llm_num_requests_running | gauge | sequences in the running batch |
| paged_llm_num_requests_waiting | gauge | sequences waiting (queued or preempted) |
| paged_llm_kv_cache_usage_ratio | gauge | fraction of KV blocks held by requests (0..1) |
| paged_llm_prefix_cache_queries_total | counter | prompt tokens looked up in the prefix cache |
| paged_llm_prefix_cache_hits_total | counter | prompt tokens served from the prefix cache |
| paged_llm_prefix_cache_hit_ratio | gauge | hits / queries since start |
| paged_llm_num_preemptions_total | counter | preemptions by recompute |
| paged_llm_prompt_tokens_computed_total | counter | prompt tokens whose KV was computed (not reused) |
| paged_llm_spec_decode_num_drafts_total | counter | sequence-steps that verified proposals (spec. decoding) |
| paged_llm_spec_decode_num_draft_tokens_total | counter | proposed tokens verified |
| paged_llm_spec_decode_num_accepted_tokens_total | counter | of those, accepted |
| paged_llm_spec_decode_acceptance_rate | gauge | accepted / proposed tokens since start |
| paged_llm_spec_decode_mean_accepted_length | gauge | tokens per verifying step: 1 + accepted / drafts |
| paged_llm_sessions_open | gauge | open sessions (core/sessions.py) |
| paged_llm_session_reused_tokens_total | counter | tokens whose KV a turn took from its session |
| paged_llm_session_kv_evictions_total | counter | idle sessions whose KV was reclaimed for other work |
| paged_llm_sessions_expired_total | counter | sessions closed after their idle TTL |
| paged_llm_session_truncations_total | counter | turns whose history was truncated to the window |
| paged_llm_engine_gc_collections_total | counter | garbage collections in the engine core process |
| paged_llm_engine_gc_pause_seconds_total | counter | time they stopped the core |
| paged_llm_engine_gc_long_pauses_total | counter | those of 5 ms or more (longer than a decode step) |
| paged_llm_prompt_tokens_total | counter | prompt tokens of requests whose prefill finished |
| paged_llm_generation_tokens_total | counter | generated tokens |
| paged_llm_request_outcomes_total{outcome} | counter | finished requests: stop, length, abort, error |
| paged_llm_final_responses_total{code} | counter | FINAL responses sent, by status code |
| paged_llm_time_to_first_token_seconds | histogram | arrival -> first generated token |
| paged_llm_inter_token_latency_seconds | histogram | time between tokens of a sequence |
| paged_llm_e2e_request_latency_seconds | histogram | arrival -> request finished |
| paged_llm_tokens_per_response | histogram | generated tokens carried by one streamed response |
| paged_llm_cancellation_checks_total | counter | is_cancelled() round trips to the server |
| paged_llm_cancellation_check_seconds_total | counter | time spent in them |

The same quantities also go out under vllm_backend's names (its `src/utils/metrics.py` at r24.12), with
its `model`/`version` labels and histogram buckets, so dashboards built for vllm_backend work:

| vllm_backend series | ours |
|---|---|
| vllm:prompt_tokens_total | paged_llm_prompt_tokens_total |
| vllm:generation_tokens_total | paged_llm_generation_tokens_total |
| vllm:time_to_first_token_seconds | paged_llm_time_to_first_token_seconds |
| vllm:time_per_output_token_seconds | paged_llm_inter_token_latency_seconds |
| vllm:e2e_request_latency_seconds | paged_llm_e2e_request_latency_seconds |
| vllm:request_prompt_tokens | prompt tokens per finished request (buckets 1, 2, 5, ... to max_model_len) |
| vllm:request_generation_tokens | tokens each finished request generated, all samples (same buckets) |
| vllm:request_params_n | `n` of each finished request (buckets 1, 2, 5, 10, 20) |

(`vllm:request_params_best_of` is not exported: vllm_backend dropped it with vLLM 0.6.3.)
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any

from paged_llm.engine.stats import EngineStats
from paged_llm.gc_pauses import LONG_PAUSE_S

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
_VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
_VLLM_N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(upper: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... while <= upper."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > upper:
                return buckets
            buckets.append(value)
        exponent += 1


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
_TOKENS_PER_RESPONSE_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128]
OUTCOMES = ("stop", "length", "abort", "error")
FINAL_CODES = ("success", "cancelled", "invalid_arg", "unavailable", "not_found", "internal")


class CounterHistogram:
    """A Prometheus histogram accumulated here; `flush()` exports what was observed since the last
    flush as increments of cumulative `_bucket{le}`, `_sum` and `_count` counter series."""

    def __init__(
        self, pb_utils: Any, name: str, description: str, buckets: list[float], labels: dict
    ) -> None:
        counter = pb_utils.MetricFamily.COUNTER
        self.families = [
            pb_utils.MetricFamily(
                name=f"{name}_bucket", description=f"{description} (cumulative buckets)", kind=counter
            ),
            pb_utils.MetricFamily(name=f"{name}_sum", description=f"{description} (sum)", kind=counter),
            pb_utils.MetricFamily(name=f"{name}_count", description=f"{description} (count)", kind=counter),
        ]
        self.bounds = [float(b) for b in buckets] + [math.inf]
        self._buckets = [
            self.families[0].Metric(labels={**labels, "le": _format_bound(b)}) for b in self.bounds
        ]
        self._sum = self.families[1].Metric(labels=labels)
        self._count = self.families[2].Metric(labels=labels)
        self._pending = [0] * len(self.bounds)  # per bucket, not cumulative
        self._pending_sum = 0.0

    def observe_many(self, values: list[float]) -> None:
        for value in values:
            self._pending[bisect.bisect_left(self.bounds, value)] += 1
            self._pending_sum += value

    def flush(self) -> None:
        cumulative = 0
        for metric, count in zip(self._buckets, self._pending):
            cumulative += count
            if cumulative:
                metric.increment(cumulative)
        if cumulative:
            self._sum.increment(self._pending_sum)
            self._count.increment(cumulative)
        self._pending = [0] * len(self.bounds)
        self._pending_sum = 0.0


def _format_bound(bound: float) -> str:
    if math.isinf(bound):
        return "+Inf"
    return str(int(bound)) if bound == int(bound) else repr(bound)


class _Gauge:
    """A gauge moved by increments (see the module docstring for why not `set`)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._value = 0.0

    def set(self, value: float) -> None:
        if value != self._value:
            self._metric.increment(value - self._value)
            self._value = value


class TritonMetrics:
    def __init__(
        self,
        pb_utils: Any,
        stats: EngineStats,
        model_name: str,
        model_version: str,
        reports_engine_state: bool = True,
        max_model_len: int = 4096,
    ) -> None:
        """`reports_engine_state` False: a front end that shares another's engine core leaves the
        core's own figures (running, waiting, KV usage, prefix cache, preemptions) to that one;
        every front end counts its own requests, tokens and responses (Triton adds them up)."""
        self._stats = stats
        self._reports_engine_state = reports_engine_state
        self._lock = threading.Lock()
        self._finals_lock = threading.Lock()
        labels = {"model": model_name, "version": model_version}
        family = pb_utils.MetricFamily
        self._families: list[Any] = []  # must outlive their metrics (the backend checks)

        def metric(name: str, description: str, kind: Any) -> Any:
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels=labels)

        def gauge(name: str, description: str) -> _Gauge:
            return _Gauge(metric(name, description, family.GAUGE))

        def per_label(name: str, description: str, label: str, values: tuple[str, ...]) -> dict[str, Any]:
            fam = family(name=name, description=description, kind=family.COUNTER)
            self._families.append(fam)
            return {v: fam.Metric(labels={**labels, label: v}) for v in values}

        def histogram(name: str, description: str, buckets: list[float]) -> CounterHistogram:
            made = CounterHistogram(pb_utils, name, description, buckets, labels)
            self._families.extend(made.families)
            return made

        self._running = gauge("paged_llm_num_requests_running", "Sequences in the running batch")
        self._waiting = gauge("paged_llm_num_requests_waiting", "Sequences waiting to run")
        self._kv_usage = gauge("paged_llm_kv_cache_usage_ratio", "Fraction of KV blocks in use")
        self._prefix_queries = metric(
            "paged_llm_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache",
            family.COUNTER,
        )
        self._prefix_hits = metric(
            "paged_llm_prefix_cache_hits_total", "Prompt tokens served by the prefix cache", family.COUNTER
        )
        self._prefix_ratio = gauge(
            "paged_llm_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens"
        )
        self._preemptions = metric(
            "paged_llm_num_preemptions_total", "Preemptions by recompute", family.COUNTER
        )
        self._prompt_computed = metric(
            "paged_llm_prompt_tokens_computed_total",
            "Prompt tokens whose KV the engine computed (not reused from a session or the prefix cache)",
            family.COUNTER,
        )
        self._spec_counters = {
            field_name: metric(name, description, family.COUNTER)
            for field_name, name, description in (
                ("spec_num_drafts", "paged_llm_spec_decode_num_drafts_total",
                 "Speculative decoding: sequence-steps that verified proposed tokens"),
                ("spec_num_draft_tokens", "paged_llm_spec_decode_num_draft_tokens_total",
                 "Speculative decoding: proposed tokens verified"),
                ("spec_num_accepted_tokens", "paged_llm_spec_decode_num_accepted_tokens_total",
                 "Speculative decoding: proposed tokens accepted"),
            )
        }  # fmt: skip
        self._spec_acceptance = gauge(
            "paged_llm_spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed tokens"
        )
        self._spec_mean_length = gauge(
            "paged_llm_spec_decode_mean_accepted_length",
            "Speculative decoding: tokens per verifying sequence-step (1 + accepted / drafts)",
        )
        self._sessions_open = gauge("paged_llm_sessions_open", "Open sessions")
        self._session_counters = {
            field_name: metric(name, description, family.COUNTER)
            for field_name, name, description in (
                ("reused_tokens_total", "paged_llm_session_reused_tokens_total",
                 "Tokens whose KV a turn took from its session"),
                ("num_evicted_total", "paged_llm_session_kv_evictions_total",
                 "Idle sessions whose KV was reclaimed for other work"),
                ("num_expired_total", "paged_llm_sessions_expired_total",
                 "Sessions closed after their idle TTL"),
                ("num_truncated_total", "paged_llm_session_truncations_total",
                 "Turns whose history was truncated to the session window"),
            )
        }  # fmt: skip
        self._gc_collections = metric(
            "paged_llm_engine_gc_collections_total", "Garbage collections in the engine core", family.COUNTER
        )
        self._gc_seconds = metric(
            "paged_llm_engine_gc_pause_seconds_total",
            "Seconds the engine core spent in garbage collection",
            family.COUNTER,
        )
        self._gc_long_pauses = metric(
            "paged_llm_engine_gc_long_pauses_total",
            f"Engine core garbage collections of {LONG_PAUSE_S * 1e3:g} ms or more",
            family.COUNTER,
        )
        self._prompt_tokens = metric(
            "paged_llm_prompt_tokens_total",
            "Prompt tokens processed (requests whose prefill finished)",
            family.COUNTER,
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
        self._cancel_checks = metric(
            "paged_llm_cancellation_checks_total", "is_cancelled() round trips to the server", family.COUNTER
        )
        self._cancel_check_seconds = metric(
            "paged_llm_cancellation_check_seconds_total", "Seconds spent in is_cancelled()", family.COUNTER
        )
        self._ttft = histogram("paged_llm_time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self._itl = histogram("paged_llm_inter_token_latency_seconds", "Time between tokens", _ITL_BUCKETS)
        self._e2e = histogram("paged_llm_e2e_request_latency_seconds", "Request latency", _E2E_BUCKETS)
        self._tokens_per_response = histogram(
            "paged_llm_tokens_per_response",
            "Generated tokens per streamed response",
            _TOKENS_PER_RESPONSE_BUCKETS,
        )
        # vllm_backend's names for the same figures (its buckets: vLLM's example ones)
        self._vllm_prompt_tokens = metric(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed.", family.COUNTER
        )
        self._vllm_generation_tokens = metric(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", family.COUNTER
        )
        self._vllm_histograms = [
            (histogram(f"vllm:{name}", f"Histogram of {what} in seconds.", buckets), observed)
            for name, what, buckets, observed in (
                (
                    "time_to_first_token_seconds",
                    "time to first token",
                    _TTFT_BUCKETS[:-1],
                    "time_to_first_token_s",
                ),
                (
                    "time_per_output_token_seconds",
                    "time per output token",
                    _VLLM_TPOT_BUCKETS,
                    "inter_token_latency_s",
                ),
                (
                    "e2e_request_latency_seconds",
                    "end to end request latency",
                    _VLLM_E2E_BUCKETS,
                    "e2e_latency_s",
                ),
            )
        ]
        token_buckets = [float(b) for b in buckets_1_2_5(max_model_len)]
        self._vllm_request_histograms = [
            (histogram(f"vllm:{name}", description, buckets), observed)
            for name, description, buckets, observed in (
                ("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets,
                 "request_prompt_tokens"),
                ("request_generation_tokens", "Number of generation tokens processed.", token_buckets,
                 "request_generation_tokens"),
                ("request_params_n", "Histogram of the n request parameter.",
                 [float(b) for b in _VLLM_N_BUCKETS], "request_n"),
            )
        ]  # fmt: skip
        self._last: dict[str, float] = {}

    def count_final(self, code: str) -> None:
        # A pb_utils Metric is not thread-safe (each call reuses the metric's own shared-memory
        # message): two threads incrementing the same counter at once crashed tritonserver 2.51
        # (SIGSEGV in the server's metric update). Its own lock, not update()'s, so that a request
        # finishing never waits for a whole metrics refresh.
        with self._finals_lock:
            self._finals[code].increment(1)

    def update(self) -> None:
        with self._lock:
            snapshot = self._stats.snapshot()
            if self._reports_engine_state:
                self._running.set(snapshot.num_running)
                self._waiting.set(snapshot.num_waiting)
                self._kv_usage.set(snapshot.kv_usage)
                queried, hits = snapshot.prefix_cache_queried_tokens, snapshot.prefix_cache_hit_tokens
                self._prefix_ratio.set(hits / queried if queried else 0.0)
                self._advance("prefix_queries", self._prefix_queries, queried)
                self._advance("prefix_hits", self._prefix_hits, hits)
                self._advance("preemptions", self._preemptions, snapshot.num_preemptions_total)
                self._advance("prompt_computed", self._prompt_computed, snapshot.prompt_tokens_computed)
                for field_name, counter in self._spec_counters.items():
                    self._advance(field_name, counter, getattr(snapshot, field_name))
                if snapshot.spec_num_drafts:
                    accepted = snapshot.spec_num_accepted_tokens
                    self._spec_acceptance.set(accepted / max(snapshot.spec_num_draft_tokens, 1))
                    self._spec_mean_length.set(1.0 + accepted / snapshot.spec_num_drafts)
                if snapshot.sessions is not None:
                    self._sessions_open.set(snapshot.sessions.num_open)
                    for field_name, counter in self._session_counters.items():
                        self._advance(
                            f"session:{field_name}", counter, getattr(snapshot.sessions, field_name)
                        )
                engine_gc = snapshot.engine_gc
                self._advance("gc_collections", self._gc_collections, engine_gc.num_collections)
                self._advance("gc_seconds", self._gc_seconds, engine_gc.pause_s_total)
                self._advance("gc_long_pauses", self._gc_long_pauses, engine_gc.num_long_pauses)
            self._advance("prompt_tokens", self._prompt_tokens, snapshot.num_prompt_tokens_total)
            self._advance("generation_tokens", self._generation_tokens, snapshot.num_generation_tokens_total)
            self._advance("vllm_prompt_tokens", self._vllm_prompt_tokens, snapshot.num_prompt_tokens_total)
            self._advance(
                "vllm_generation_tokens", self._vllm_generation_tokens, snapshot.num_generation_tokens_total
            )
            for outcome, counter in self._outcomes.items():
                self._advance(f"outcome:{outcome}", counter, snapshot.num_requests_by_outcome.get(outcome, 0))
            self._advance("cancel_checks", self._cancel_checks, snapshot.num_cancellation_checks)
            self._advance("cancel_seconds", self._cancel_check_seconds, snapshot.cancellation_check_seconds)
            observations = self._stats.drain_observations()
            for histogram, values in (
                (self._ttft, observations.time_to_first_token_s),
                (self._itl, observations.inter_token_latency_s),
                (self._e2e, observations.e2e_latency_s),
                (self._tokens_per_response, observations.tokens_per_response),
            ):
                histogram.observe_many(values)
                histogram.flush()
            for histogram, field_name in (*self._vllm_histograms, *self._vllm_request_histograms):
                histogram.observe_many(getattr(observations, field_name))
                histogram.flush()

    def _advance(self, key: str, counter: Any, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.increment(delta)
            self._last[key] = total
