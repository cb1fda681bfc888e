"""Engine statistics -> Prometheus metrics on Triton's /metrics endpoint.

Triton's Python backend exposes custom metrics through `pb_utils.MetricFamily`; llm_model.py passes the
`pb_utils` module in, so this module has no import-time dependency on Triton. Every metric operation
of the Python backend is a round trip to the server process (measured on a 2-core machine: 25-45 us
each, on the same channel as the responses), so updates cost calls for what changed only:

* `update_requests()`: the request counters (tokens, outcomes, streamed responses), advanced by
  what changed since the previous update. `before_final()` calls it, so a client that reads
  /metrics after its last response sees its request counted; ResponseStreams calls it before a
  request's FINAL response. For the stub's last request in flight it also waits for the histogram
  writer to settle (triton_model/histogram_writer.py: the histograms' observations, one round trip
  each, go out on a thread of their own): a final that waits blocks its send thread, and with other
  streams in flight their tokens would wait behind it (on an H100 at 16 streams, 10-40 ms gaps and
  ~10% less served throughput).
* `update()`: every ~0.5 s on the housekeeping thread: the engine state (gauges, prefix cache,
  preemptions, sessions, GC, structured output, cancellation polling), then `update_requests()`.
  Gauges move by `increment(delta)`: `set()` holds the GIL while it waits for the server (Triton
  2.51), `increment` releases it.

A pb_utils Metric is not thread-safe (each call reuses the metric's own shared-memory message: two
threads incrementing the same counter at once crashed tritonserver 2.51), so each group of metrics
has its own lock (the histograms their own thread), and a request finishing never waits for a whole
engine-state refresh.

The metrics themselves (names, kinds, buckets, vllm_backend's series): triton_model/metric_families.py.
"""

from __future__ import annotations

import threading
from typing import Any

from paged_llm.engine.stats import EngineStats, StatsSnapshot
from paged_llm.engine.step_times import KINDS as STEP_KINDS
from paged_llm.triton_model.histogram_writer import HistogramWriter
from paged_llm.triton_model.metric_families import MetricFamilies, _Gauge

ENGINE_UP_METRIC = "paged_llm_engine_up"


class TritonMetrics:
    def __init__(
        self,
        pb_utils: Any,
        stats: EngineStats,
        model_name: str,
        model_version: str,
        reports_engine_state: bool = True,
        max_model_len: int = 4096,
        lora_names: tuple[str, ...] = (),
        final_histogram_wait_s: float = 0.05,
    ) -> None:
        """`reports_engine_state` False: a stub that shares another's engine core leaves the
        core's own figures (running, waiting, KV usage, prefix cache, preemptions, engine up) to
        that one; every stub counts its own requests, tokens and responses (Triton adds them
        up). After a restart of the core its new owner reports them (the stats' `owns_core`)."""
        self._stats = stats
        self._reports_engine_state = reports_engine_state
        self._final_histogram_wait_s = final_histogram_wait_s
        self._lock = threading.Lock()
        self._requests_lock = threading.Lock()
        self._finals_lock = threading.Lock()
        labels = {"model": model_name, "version": model_version}
        self._metrics = MetricFamilies(pb_utils, labels, max_model_len, lora_names)
        family = pb_utils.MetricFamily
        self._engine_up_family = family(
            name=ENGINE_UP_METRIC,
            description="1 while the engine core serves; 0 while it is down, restarting, or given up",
            kind=family.GAUGE,
        )
        self._engine_up = _Gauge(self._engine_up_family.Metric(labels=labels))
        self._last: dict[str, float] = {}
        self._histograms = HistogramWriter(
            stats.drain_observations, stats.num_pending_observations, self._metrics.histogram_sources
        )
        self._histograms.start()

    def stop(self) -> None:
        """Sends the histograms' pending observations and ends their thread."""
        self._histograms.stop()

    def before_final(self, wait_for_histograms: bool) -> None:
        """A request's final response is about to leave: its counters now, and its histograms too
        when `wait_for_histograms` (the stub's last request in flight; see the module docstring)."""
        self.update_requests()
        if wait_for_histograms and self._final_histogram_wait_s > 0:
            self._histograms.settle(timeout_s=self._final_histogram_wait_s)

    def count_final(self, code: str) -> None:
        with self._finals_lock:
            self._metrics.finals[code].increment(1)

    def update(self) -> None:
        with self._lock:
            snapshot = self._stats.snapshot()
            reports_engine_state = self._reports_engine_state and snapshot.owns_core
            # (a gauge of several stubs adds up their increments: only the owner's counts)
            self._engine_up.set(1.0 if reports_engine_state and snapshot.engine_up else 0.0)
            if reports_engine_state:
                self._update_engine_state(snapshot)
            self._advance("cancel_checks", self._metrics.cancel_checks, snapshot.num_cancellation_checks)
            self._advance(
                "cancel_seconds", self._metrics.cancel_check_seconds, snapshot.cancellation_check_seconds
            )
        self.update_requests()

    def _update_engine_state(self, snapshot: StatsSnapshot) -> None:
        self._metrics.running.set(snapshot.num_running)
        self._metrics.waiting.set(snapshot.num_waiting)
        self._metrics.kv_usage.set(snapshot.kv_usage)
        queried, hits = snapshot.prefix_cache_queried_tokens, snapshot.prefix_cache_hit_tokens
        self._metrics.prefix_ratio.set(hits / queried if queried else 0.0)
        self._advance("prefix_queries", self._metrics.prefix_queries, queried)
        self._advance("prefix_hits", self._metrics.prefix_hits, hits)
        self._advance("preemptions", self._metrics.preemptions, snapshot.num_preemptions_total)
        self._advance("prompt_computed", self._metrics.prompt_computed, snapshot.prompt_tokens_computed)
        for field_name, counter in (
            *self._metrics.spec_counters.items(),
            *self._metrics.lora_counters.items(),
        ):
            self._advance(field_name, counter, getattr(snapshot, field_name))
        if snapshot.spec_num_drafts:
            accepted = snapshot.spec_num_accepted_tokens
            self._metrics.spec_acceptance.set(accepted / max(snapshot.spec_num_draft_tokens, 1))
            self._metrics.spec_mean_length.set(1.0 + accepted / snapshot.spec_num_drafts)
        self._metrics.lora_slots_used.set(snapshot.num_lora_slots_used)
        if snapshot.sessions is not None:
            self._metrics.sessions_open.set(snapshot.sessions.num_open)
            for field_name, counter in self._metrics.session_counters.items():
                self._advance(f"session:{field_name}", counter, getattr(snapshot.sessions, field_name))
        engine_gc = snapshot.engine_gc
        self._advance("gc_collections", self._metrics.gc_collections, engine_gc.num_collections)
        self._advance("gc_seconds", self._metrics.gc_seconds, engine_gc.pause_s_total)
        self._advance("gc_long_pauses", self._metrics.gc_long_pauses, engine_gc.num_long_pauses)
        for kind in STEP_KINDS:
            num_steps, seconds = snapshot.engine_steps.count_and_seconds(kind)
            self._advance(f"steps:{kind}", self._metrics.engine_steps[kind], num_steps)
            self._advance(f"step_seconds:{kind}", self._metrics.engine_step_seconds[kind], seconds)
        structured = snapshot.structured_output
        for kind, counter in self._metrics.structured_output_requests.items():
            self._advance(f"structured_output:{kind}", counter, structured.requests_by_kind.get(kind, 0))
        for field_name, counter in self._metrics.structured_output_counters.items():
            self._advance(f"structured_output:{field_name}", counter, getattr(structured, field_name))

    def update_requests(self) -> None:
        """The request counters as of now (see the module docstring); any thread."""
        with self._requests_lock:
            snapshot = self._stats.snapshot()
            prompt_tokens = snapshot.num_prompt_tokens_total
            generation_tokens = snapshot.num_generation_tokens_total
            self._advance("prompt_tokens", self._metrics.prompt_tokens, prompt_tokens)
            self._advance("generation_tokens", self._metrics.generation_tokens, generation_tokens)
            self._advance("vllm_prompt_tokens", self._metrics.vllm_prompt_tokens, prompt_tokens)
            self._advance("vllm_generation_tokens", self._metrics.vllm_generation_tokens, generation_tokens)
            for outcome, counter in self._metrics.outcomes.items():
                self._advance(f"outcome:{outcome}", counter, snapshot.num_requests_by_outcome.get(outcome, 0))
            for name, count in snapshot.num_requests_by_lora.items():
                self._advance(f"lora:{name}", self._metrics.lora_counter(name), count)
            self._advance(
                "streamed_responses", self._metrics.streamed_responses, snapshot.num_streamed_responses
            )
            self._advance(
                "streamed_response_tokens",
                self._metrics.streamed_response_tokens,
                snapshot.num_streamed_response_tokens,
            )
            self._advance(
                "observations_dropped", self._metrics.observations_dropped, snapshot.num_observations_dropped
            )

    def _advance(self, key: str, counter: Any, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.increment(delta)
            self._last[key] = total
