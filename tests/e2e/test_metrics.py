"""paged_llm's own metrics on Triton's /metrics endpoint, checked after a known workload."""

from __future__ import annotations

import time
import uuid

from tests.e2e.client import make_inputs, stream, stream_many
from tests.e2e.metrics import parse, value, wait_for, wait_idle

NUM_REQUESTS = 5
MAX_TOKENS = 7

COUNTERS = {
    "generation": ("paged_llm_generation_tokens_total", {}),
    "prompt": ("paged_llm_prompt_tokens_total", {}),
    "length": ("paged_llm_request_outcomes_total", {"outcome": "length"}),
    "success": ("paged_llm_final_responses_total", {"code": "success"}),
    "ttft": ("paged_llm_time_to_first_token_seconds_count", {}),
    "itl": ("paged_llm_inter_token_latency_seconds_count", {}),
    "e2e": ("paged_llm_e2e_request_latency_seconds_count", {}),
    # vllm_backend's names for the same figures (its src/utils/metrics.py at r24.12)
    "vllm_generation": ("vllm:generation_tokens_total", {}),
    "vllm_prompt": ("vllm:prompt_tokens_total", {}),
    "vllm_ttft": ("vllm:time_to_first_token_seconds_count", {}),
    "vllm_tpot": ("vllm:time_per_output_token_seconds_count", {}),
    "vllm_e2e": ("vllm:e2e_request_latency_seconds_count", {}),
    "vllm_request_prompt": ("vllm:request_prompt_tokens_sum", {}),
    "vllm_request_generation": ("vllm:request_generation_tokens_sum", {}),
    "vllm_request_generation_count": ("vllm:request_generation_tokens_count", {}),
    "vllm_n": ("vllm:request_params_n_sum", {}),
}


def read(server) -> dict[str, float]:
    text = server.metrics()
    return {key: value(text, name, **labels) for key, (name, labels) in COUNTERS.items()}


def test_metrics_after_a_known_workload(server):
    wait_idle(server)  # earlier tests' stragglers (e.g. perf_analyzer's last requests) must not count
    time.sleep(0.6)  # one more metrics refresh after the last of them finished
    before = read(server)
    before_text = server.metrics()
    decode_steps_before = value(before_text, "paged_llm_engine_steps_total", kind="decode")
    decode_seconds_before = value(before_text, "paged_llm_engine_step_seconds_total", kind="decode")
    requests = [
        make_inputs(
            f"metrics prompt number {i} " * (i + 1),
            sampling_parameters={"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0},
            return_num_input_tokens=True,
        )
        for i in range(NUM_REQUESTS)
    ]
    results = stream_many(server.grpc_url, requests)
    assert all(r.finals == 1 and not r.errors for r in results)
    prompt_tokens = sum(int(r.last("num_input_tokens")[0]) for r in results)
    expected = {
        "generation": NUM_REQUESTS * MAX_TOKENS,
        "prompt": prompt_tokens,
        "length": NUM_REQUESTS,
        "success": NUM_REQUESTS,
        "ttft": NUM_REQUESTS,
        "itl": NUM_REQUESTS * (MAX_TOKENS - 1),
        "e2e": NUM_REQUESTS,
        "vllm_generation": NUM_REQUESTS * MAX_TOKENS,
        "vllm_prompt": prompt_tokens,
        "vllm_ttft": NUM_REQUESTS,
        "vllm_tpot": NUM_REQUESTS * (MAX_TOKENS - 1),
        "vllm_e2e": NUM_REQUESTS,
        "vllm_request_prompt": prompt_tokens,
        "vllm_request_generation": NUM_REQUESTS * MAX_TOKENS,
        "vllm_request_generation_count": NUM_REQUESTS,
        "vllm_n": NUM_REQUESTS,  # n = 1 each
    }

    def deltas() -> dict[str, float]:
        now = read(server)
        return {key: now[key] - before[key] for key in expected}

    assert wait_for(lambda: deltas() == expected, timeout_s=10), (deltas(), expected)
    text = server.metrics()
    # Histograms are populated: the first-token latencies fall in some finite bucket.
    assert value(text, "paged_llm_time_to_first_token_seconds_bucket", le="+Inf") >= NUM_REQUESTS
    assert value(text, "paged_llm_e2e_request_latency_seconds_sum") > 0
    series = parse(text)
    for name, bound in (
        ("vllm:time_to_first_token_seconds_bucket", "0.001"),
        ("vllm:e2e_request_latency_seconds_bucket", "60"),
        ("vllm:request_prompt_tokens_bucket", "2000"),  # 1, 2, 5, ... up to max_model_len 4096
        ("vllm:request_params_n_bucket", "20"),
    ):  # vllm_backend's buckets
        wanted = {("le", bound), ("model", "llm"), ("version", "1")}
        assert any(n == name and set(labels) == wanted for n, labels in series), name
    for gauge in (
        "paged_llm_num_requests_running",
        "paged_llm_num_requests_waiting",
        "paged_llm_kv_cache_usage_ratio",
    ):
        assert f"{gauge}{{" in text
    assert "paged_llm_prefix_cache_hit_ratio{" in text
    # The engine core's garbage collections are exported (how many there were depends on the run).
    for counter in (
        "paged_llm_engine_gc_collections_total",
        "paged_llm_engine_gc_pause_seconds_total",
        "paged_llm_engine_gc_long_pauses_total",
    ):
        assert f"{counter}{{" in text

    # The core's busy steps (their gauge-like refresh may come a tick after the token counters):
    # this workload's decodes ran back to back, each a counted period.
    def decode_steps() -> tuple[float, float]:
        now = server.metrics()
        return (
            value(now, "paged_llm_engine_steps_total", kind="decode") - decode_steps_before,
            value(now, "paged_llm_engine_step_seconds_total", kind="decode") - decode_seconds_before,
        )

    assert wait_for(lambda: decode_steps()[0] >= MAX_TOKENS - 2, timeout_s=10), decode_steps()
    assert decode_steps()[1] > 0.0


STRUCTURED_OUTPUT = {
    "regex": ("paged_llm_structured_output_requests_total", {"kind": "regex"}),
    "compiles": ("paged_llm_grammar_compiles_total", {}),
    "cache_hits": ("paged_llm_grammar_cache_hits_total", {}),
    "compile_errors": ("paged_llm_grammar_compile_errors_total", {}),
    "length_in_grammar": ("paged_llm_structured_output_length_in_grammar_total", {}),
    "compile_seconds": ("paged_llm_grammar_compile_seconds_count", {}),
}


def test_structured_output_counters_and_the_grammar_compile_histogram(server):
    """A regex no earlier request used (so it compiles), the same again (a cache hit) cut short by
    max_tokens mid-grammar, and one that does not compile."""

    def read_structured() -> dict[str, float]:
        text = server.metrics()
        return {key: value(text, name, **labels) for key, (name, labels) in STRUCTURED_OUTPUT.items()}

    def mask_fills() -> tuple[float, float]:
        text = server.metrics()
        return (
            value(text, "paged_llm_grammar_mask_fills_total"),
            value(text, "paged_llm_grammar_mask_fill_seconds_total"),
        )

    before = read_structured()
    fills_before, fill_seconds_before = mask_fills()
    regex = f"metrics-{uuid.uuid4().hex[:8]}-[0-9]{{6}}"  # longer than the 3 tokens of the second request
    for max_tokens in (64, 3):
        params = {"temperature": 0, "max_tokens": max_tokens, "structured_outputs": {"regex": regex}}
        result = stream(server.grpc_url, "structured", sampling_parameters=params, return_finish_reason=True)
        assert not result.errors, result.errors
        assert result.last("finish_reason").tolist() == [b"stop" if max_tokens == 64 else b"length"]
    bad = stream(server.grpc_url, "structured", sampling_parameters={"structured_outputs": {"regex": "(("}})
    assert len(bad.errors) == 1 and "structured_outputs.regex" in bad.errors[0], bad.errors
    expected = {"regex": 3, "compiles": 1, "cache_hits": 1, "compile_errors": 1, "length_in_grammar": 1,
                "compile_seconds": 2}  # fmt: skip

    def deltas() -> dict[str, float]:
        now = read_structured()
        return {key: now[key] - before[key] for key in expected}

    assert wait_for(lambda: deltas() == expected, timeout_s=10), (deltas(), expected)
    # every token of the two constrained requests came from a step with a mask (the 3-token one alone: 3)
    assert wait_for(lambda: mask_fills()[0] - fills_before >= 4, timeout_s=10), mask_fills()
    assert mask_fills()[1] > fill_seconds_before
    text = server.metrics()
    assert value(text, "paged_llm_grammar_compile_seconds_sum") > 0
    wanted = {("le", "30"), ("model", "llm"), ("version", "1")}
    assert any(n == "paged_llm_grammar_compile_seconds_bucket" and set(ls) == wanted for n, ls in parse(text))
