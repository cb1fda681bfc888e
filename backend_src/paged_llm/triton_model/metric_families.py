"""Every metric family this backend exports, declared once against `pb_utils` (see triton_model/metrics.py
for how and when they are updated). Histograms are Triton histogram families (triton_model/histograms.py).

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
| paged_llm_lora_requests_total{lora_name} | counter | finished requests that generated with a LoRA adapter |
| paged_llm_lora_adapter_loads_total | counter | adapters written into a device slot |
| paged_llm_lora_adapter_evictions_total | counter | of those, ones that replaced another adapter |
| paged_llm_lora_slots_used | gauge | device slots holding an adapter (of max_loras) |
| paged_llm_sessions_open | gauge | open sessions (core/sessions.py) |
| paged_llm_session_reused_tokens_total | counter | tokens whose KV a turn took from its session |
| paged_llm_session_kv_evictions_total | counter | idle sessions whose KV was reclaimed for other work |
| paged_llm_sessions_expired_total | counter | sessions closed after their idle TTL |
| paged_llm_session_truncations_total | counter | turns whose history was truncated to the window |
| paged_llm_engine_gc_collections_total | counter | garbage collections in the engine core process |
| paged_llm_engine_gc_pause_seconds_total | counter | time they stopped the core |
| paged_llm_engine_gc_long_pauses_total | counter | those of 5 ms or more (longer than a decode step) |
| paged_llm_engine_steps_total{kind} | counter | busy core steps: `decode`, `prefill` (engine/step_times.py) |
| paged_llm_engine_step_seconds_total{kind} | counter | their periods; / steps = the mean step |
| paged_llm_prompt_tokens_total | counter | prompt tokens of requests whose prefill finished |
| paged_llm_generation_tokens_total | counter | generated tokens |
| paged_llm_request_outcomes_total{outcome} | counter | finished requests: stop, length, abort, error |
| paged_llm_final_responses_total{code} | counter | FINAL responses sent, by status code |
| paged_llm_time_to_first_token_seconds | histogram | arrival -> first generated token |
| paged_llm_inter_token_latency_seconds | histogram | time between tokens of a sequence |
| paged_llm_e2e_request_latency_seconds | histogram | arrival -> request finished |
| paged_llm_streamed_responses_total | counter | streamed responses that carried tokens |
| paged_llm_streamed_response_tokens_total | counter | the tokens they carried (/ responses: coalescing) |
| paged_llm_histogram_observations_dropped_total | counter | dropped: the histograms fell far behind |
| paged_llm_cancellation_checks_total | counter | is_cancelled() round trips to the server |
| paged_llm_cancellation_check_seconds_total | counter | time spent in them |
| paged_llm_structured_output_requests_total{kind} | counter | constrained requests by kind |
| paged_llm_grammar_compiles_total | counter | grammars compiled (cache misses that compiled) |
| paged_llm_grammar_cache_hits_total | counter | constrained requests whose grammar was cached |
| paged_llm_grammar_compile_errors_total | counter | constraints that did not compile (timeouts included) |
| paged_llm_grammar_compile_timeouts_total | counter | compiles that overran grammar_compile_timeout_s |
| paged_llm_grammar_compile_seconds | histogram | time of each compile (failed ones included) |
| paged_llm_structured_output_length_in_grammar_total | counter | constrained sequences cut short by length |
| paged_llm_grammar_mask_fills_total | counter | engine steps whose grammar bitmask was filled |
| paged_llm_grammar_mask_fill_seconds_total | counter | the time of those fills |
| paged_llm_grammar_mask_wait_seconds_total | counter | the engine thread's waits for a fill beside it |

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

from typing import Any

from paged_llm.engine.step_times import KINDS as STEP_KINDS
from paged_llm.gc_pauses import LONG_PAUSE_S
from paged_llm.structured_output_params import KINDS as STRUCTURED_OUTPUT_KINDS
from paged_llm.triton_model.histograms import Histogram, buckets_1_2_5

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
# From a short regex (~1 ms) past grammar_compile_timeout_s (10 s by default; a timed-out compile counts).
_GRAMMAR_COMPILE_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
]
OUTCOMES = ("stop", "length", "abort", "error")
FINAL_CODES = ("success", "cancelled", "invalid_arg", "unavailable", "not_found", "internal")


class _Gauge:
    """A gauge moved by increments (triton_model/metrics.py's docstring says why not `set`)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._value = 0.0

    def set(self, value: float) -> None:
        if value != self._value:
            self._metric.increment(value - self._value)
            self._value = value


class MetricFamilies:
    """The metrics of one model instance, each with the instance's `model`/`version` labels."""

    def __init__(
        self, pb_utils: Any, labels: dict[str, str], max_model_len: int, lora_names: tuple[str, ...] = ()
    ) -> None:
        family = pb_utils.MetricFamily
        self.families: list[Any] = []  # must outlive their metrics (the backend checks)

        def metric(name: str, description: str, kind: Any) -> Any:
            fam = family(name=name, description=description, kind=kind)
            self.families.append(fam)
            return fam.Metric(labels=labels)

        def gauge(name: str, description: str) -> _Gauge:
            return _Gauge(metric(name, description, family.GAUGE))

        def per_label(name: str, description: str, label: str, values: tuple[str, ...]) -> dict[str, Any]:
            fam = family(name=name, description=description, kind=family.COUNTER)
            self.families.append(fam)
            return {v: fam.Metric(labels={**labels, label: v}) for v in values}

        self._labels = labels
        self._lora_family = family(
            name="paged_llm_lora_requests_total",
            description="Finished requests that generated tokens with a LoRA adapter",
            kind=family.COUNTER,
        )
        self.families.append(self._lora_family)

        def histogram(name: str, description: str, buckets: list[float]) -> Histogram:
            made = Histogram(pb_utils, name, description, buckets, labels)
            self.families.extend(made.families)
            return made

        self.running = gauge("paged_llm_num_requests_running", "Sequences in the running batch")
        self.waiting = gauge("paged_llm_num_requests_waiting", "Sequences waiting to run")
        self.kv_usage = gauge("paged_llm_kv_cache_usage_ratio", "Fraction of KV blocks in use")
        self.prefix_queries = metric(
            "paged_llm_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache",
            family.COUNTER,
        )
        self.prefix_hits = metric(
            "paged_llm_prefix_cache_hits_total", "Prompt tokens served by the prefix cache", family.COUNTER
        )
        self.prefix_ratio = gauge(
            "paged_llm_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens"
        )
        self.preemptions = metric(
            "paged_llm_num_preemptions_total", "Preemptions by recompute", family.COUNTER
        )
        self.prompt_computed = metric(
            "paged_llm_prompt_tokens_computed_total",
            "Prompt tokens whose KV the engine computed (not reused from a session or the prefix cache)",
            family.COUNTER,
        )
        self.spec_counters = {
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
        self.spec_acceptance = gauge(
            "paged_llm_spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed tokens"
        )
        self.spec_mean_length = gauge(
            "paged_llm_spec_decode_mean_accepted_length",
            "Speculative decoding: tokens per verifying sequence-step (1 + accepted / drafts)",
        )
        # the adapters served from the start; adapters loaded while serving get theirs on first use
        self.lora_requests: dict[str, Any] = {}
        for lora_name in lora_names:
            self.lora_counter(lora_name)
        self.lora_counters = {
            field_name: metric(name, description, family.COUNTER)
            for field_name, name, description in (
                ("lora_loads_total", "paged_llm_lora_adapter_loads_total",
                 "LoRA adapters written into a device slot"),
                ("lora_evictions_total", "paged_llm_lora_adapter_evictions_total",
                 "LoRA adapter loads that replaced another adapter in its slot"),
            )
        }  # fmt: skip
        self.lora_slots_used = gauge("paged_llm_lora_slots_used", "Device slots holding a LoRA adapter")
        self.sessions_open = gauge("paged_llm_sessions_open", "Open sessions")
        self.session_counters = {
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
        self.gc_collections = metric(
            "paged_llm_engine_gc_collections_total", "Garbage collections in the engine core", family.COUNTER
        )
        self.gc_seconds = metric(
            "paged_llm_engine_gc_pause_seconds_total",
            "Seconds the engine core spent in garbage collection",
            family.COUNTER,
        )
        self.gc_long_pauses = metric(
            "paged_llm_engine_gc_long_pauses_total",
            f"Engine core garbage collections of {LONG_PAUSE_S * 1e3:g} ms or more",
            family.COUNTER,
        )
        self.engine_steps = per_label(
            "paged_llm_engine_steps_total", "Engine core steps taken while busy", "kind", STEP_KINDS
        )
        self.engine_step_seconds = per_label(
            "paged_llm_engine_step_seconds_total",
            "Seconds of busy engine core steps, each from the end of the step before",
            "kind",
            STEP_KINDS,
        )
        self.prompt_tokens = metric(
            "paged_llm_prompt_tokens_total",
            "Prompt tokens processed (requests whose prefill finished)",
            family.COUNTER,
        )
        self.generation_tokens = metric(
            "paged_llm_generation_tokens_total", "Tokens generated", family.COUNTER
        )
        self.outcomes = per_label(
            "paged_llm_request_outcomes_total", "Finished requests by outcome", "outcome", OUTCOMES
        )
        self.finals = per_label(
            "paged_llm_final_responses_total", "FINAL responses sent, by status", "code", FINAL_CODES
        )
        self.cancel_checks = metric(
            "paged_llm_cancellation_checks_total", "is_cancelled() round trips to the server", family.COUNTER
        )
        self.cancel_check_seconds = metric(
            "paged_llm_cancellation_check_seconds_total", "Seconds spent in is_cancelled()", family.COUNTER
        )
        self.ttft = histogram("paged_llm_time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = histogram("paged_llm_inter_token_latency_seconds", "Time between tokens", _ITL_BUCKETS)
        self.e2e = histogram("paged_llm_e2e_request_latency_seconds", "Request latency", _E2E_BUCKETS)
        # Counters, not a histogram: a histogram costs a round trip per streamed response
        self.streamed_responses = metric(
            "paged_llm_streamed_responses_total", "Streamed responses that carried tokens", family.COUNTER
        )
        self.streamed_response_tokens = metric(
            "paged_llm_streamed_response_tokens_total",
            "Generated tokens carried by streamed responses",
            family.COUNTER,
        )
        self.observations_dropped = metric(
            "paged_llm_histogram_observations_dropped_total",
            "Histogram observations dropped because the histograms fell too far behind",
            family.COUNTER,
        )
        self.structured_output_requests = per_label(
            "paged_llm_structured_output_requests_total",
            "Structured output requests by constraint kind",
            "kind",
            STRUCTURED_OUTPUT_KINDS,
        )
        # StructuredOutputStats field -> counter
        self.structured_output_counters = {
            field_name: metric(name, description, family.COUNTER)
            for field_name, name, description in (
                ("num_compiles", "paged_llm_grammar_compiles_total",
                 "Grammars compiled (cache misses that compiled)"),
                ("num_cache_hits", "paged_llm_grammar_cache_hits_total",
                 "Structured output requests whose grammar was compiled already"),
                ("num_compile_errors", "paged_llm_grammar_compile_errors_total",
                 "Constraints that did not compile (timeouts included)"),
                ("num_compile_timeouts", "paged_llm_grammar_compile_timeouts_total",
                 "Grammar compiles that overran grammar_compile_timeout_s"),
                ("num_length_in_grammar", "paged_llm_structured_output_length_in_grammar_total",
                 "Constrained sequences ended by max_tokens or max_model_len before their grammar ended"),
                ("num_mask_fills", "paged_llm_grammar_mask_fills_total",
                 "Engine steps whose grammar token bitmask was filled"),
                ("mask_fill_seconds", "paged_llm_grammar_mask_fill_seconds_total",
                 "Time of those fills"),
                ("mask_wait_seconds", "paged_llm_grammar_mask_wait_seconds_total",
                 "Time the engine thread waited for a fill running beside it"),
            )
        }  # fmt: skip
        self.grammar_compile = histogram(
            "paged_llm_grammar_compile_seconds", "Time to compile a grammar", _GRAMMAR_COMPILE_BUCKETS
        )
        # vllm_backend's names for the same figures (its buckets: vLLM's example ones)
        self.vllm_prompt_tokens = metric(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed.", family.COUNTER
        )
        self.vllm_generation_tokens = metric(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", family.COUNTER
        )
        self.vllm_histograms = [
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
        self.vllm_request_histograms = [
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
        # every histogram and the LatencyObservations field it observes (triton_model/histogram_writer.py)
        self.histogram_sources = [
            (self.ttft, "time_to_first_token_s"),
            (self.itl, "inter_token_latency_s"),
            (self.e2e, "e2e_latency_s"),
            *self.vllm_histograms,
            *self.vllm_request_histograms,
            (self.grammar_compile, "grammar_compile_s"),
        ]

    def lora_counter(self, lora_name: str) -> Any:
        """The finished-requests counter of an adapter, made on its first use (adapters can be
        loaded while serving); only names of adapters that generated tokens reach here."""
        counter = self.lora_requests.get(lora_name)
        if counter is None:
            labels = {**self._labels, "lora_name": lora_name}
            counter = self.lora_requests[lora_name] = self._lora_family.Metric(labels=labels)
        return counter
