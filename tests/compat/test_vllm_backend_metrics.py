"""vllm_backend's metrics expectations, stated as our tests (issue "Reliability and security round 3",
row 10). They follow ci/L0_backend_vllm/metrics_test/vllm_metrics_test.py of
triton-inference-server/vllm_backend at main (8de0c148bda1da25de1e05ffaaf67116dacc7264; r24.10,
b71088af874878c2b734ca098422d8d48f502539, runs one round instead of two); the code is ours.

Upstream reads /metrics right after the last response of its requests, keeps the last sample of
each name (for a histogram's `_bucket` that must be `le="+Inf"`) and expects OPT's token counts: 6
prompt tokens per prompt (BOS + 5 words) and 16 generated (vLLM's default max_tokens). The prompts
here are 6 tokens to the tiny model (it adds no BOS), and generate 16 tokens greedily."""

from __future__ import annotations

import json
import queue
import re
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from tests.e2e.metrics import value, wait_for

PROMPTS = ["The most dangerous animal is the", "The capital of France is Paris", "The future of AI is bright"]
SAMPLING = {"temperature": "0", "top_p": "1"}
ROUNDS = 2  # upstream main: "in case metrics are updated but engine crashes"
PROMPT_TOKENS, GENERATED_TOKENS = 6, 16
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_n",
)
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
_SAMPLE = re.compile(r"^(vllm:[^ {]+)(?:{.*})? ([0-9.-]+)$", re.M)  # upstream's pattern


def last_samples(text: str) -> dict[str, float]:
    """Upstream's reading: the last sample of each vllm: name."""
    return {name: float(number) for name, number in _SAMPLE.findall(text)}


def vllm_request(prompt: str) -> list[grpcclient.InferInput]:
    """upstream's create_vllm_request: text_input, stream False, sampling_parameters as a tensor."""
    values = {
        "text_input": ("BYTES", np.array([prompt.encode()], dtype=np.object_)),
        "stream": ("BOOL", np.array([False])),
        "sampling_parameters": ("BYTES", np.array([json.dumps(SAMPLING).encode()], dtype=np.object_)),
    }
    inputs = []
    for name, (datatype, array) in values.items():
        inputs.append(grpcclient.InferInput(name, [1], datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def run_rounds(server) -> None:
    """Upstream's vllm_infer: per round, one gRPC stream, the prompts sent at once, every answer taken."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    try:
        for _round in range(ROUNDS):
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            for index, prompt in enumerate(PROMPTS):
                client.async_stream_infer(
                    "llm",
                    vllm_request(prompt),
                    request_id=str(index),
                    outputs=[grpcclient.InferRequestedOutput("text_output")],
                    parameters=SAMPLING,
                )
            for _ in PROMPTS:
                result, error = answers.get(timeout=60)
                assert error is None, error
                assert result.as_numpy("text_output") is not None
            client.stop_stream()
    finally:
        client.close()


def read_metrics(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return response.read().decode()


def test_vllm_series_count_every_request_by_the_time_its_last_response_arrives(server):
    before = read_metrics(server)
    run_rounds(server)
    after = read_metrics(server)  # at once, as upstream: no refresh to wait for

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    requests = len(PROMPTS) * ROUNDS
    prompt_tokens, generated = PROMPT_TOKENS * requests, GENERATED_TOKENS * requests
    expected = {
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": generated,
        "vllm:time_to_first_token_seconds_count": requests,
        "vllm:time_per_output_token_seconds_count": generated - requests,
        "vllm:e2e_request_latency_seconds_count": requests,
        "vllm:request_prompt_tokens_count": requests,
        "vllm:request_prompt_tokens_sum": prompt_tokens,
        "vllm:request_generation_tokens_count": requests,
        "vllm:request_generation_tokens_sum": generated,
        "vllm:request_params_n_count": requests,
        "vllm:request_params_n_sum": requests,
    }
    assert {name: delta(name) for name in expected} == expected
    for name in HISTOGRAMS:
        buckets_delta = value(after, f"{name}_bucket", le="+Inf") - value(before, f"{name}_bucket", le="+Inf")
        assert buckets_delta == expected[f"{name}_count"], name
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert delta(f"{name}_sum") > 0
    # Upstream's reading of the same text: what it takes for a bucket count is +Inf's.
    last = last_samples(after)
    for name in HISTOGRAMS:
        assert last[f"{name}_bucket"] == last[f"{name}_count"], name


def test_vllm_histograms_are_prometheus_histograms_with_ordered_cumulative_buckets(server):
    run_rounds(server)
    text = read_metrics(server)
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text, name
        bucket_lines = re.findall(
            rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M
        )
        bounds = [float(bound) for bound, _count in bucket_lines]
        counts = [float(count) for _bound, count in bucket_lines]
        assert bounds == sorted(bounds) and bounds[-1] == float("inf"), (name, bounds)
        assert counts == sorted(counts), (name, counts)  # cumulative
        assert counts[-1] == value(text, f"{name}_count"), name
    for name in COUNTERS:
        assert f"# TYPE {name} counter" in text


def test_the_health_probe_is_answered_without_counting_in_the_request_metrics(server):
    """The OpenAI server's /health probe (openai/triton_client.py) is answered by the llm model
    from the engine's state: no tokens, no vllm:* or paged_llm request figure moves (Triton's own
    nv_inference_* counters count it, as they count every request)."""
    before = read_metrics(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    ids = grpcclient.InferInput("input_ids", [1], "INT32")
    ids.set_data_from_numpy(np.array([0], dtype=np.int32))
    client.async_stream_infer("llm", [ids], parameters={"paged_llm_health_probe": True})
    result, error = answers.get(timeout=30)
    client.stop_stream()
    client.close()
    assert error is None, error
    assert result.as_numpy("text_output") is None and result.as_numpy("output_ids") is None
    # Triton counts the request once it has released it, a moment after the FINAL reached us
    successes_before = value(before, "nv_inference_request_success", model="llm")
    assert wait_for(
        lambda: value(read_metrics(server), "nv_inference_request_success", model="llm") > successes_before,
        timeout_s=30,
    )
    after = read_metrics(server)
    for name in (
        *COUNTERS,
        *(f"{h}_count" for h in HISTOGRAMS),
        "paged_llm_generation_tokens_total",
        "paged_llm_final_responses_total",
        "paged_llm_e2e_request_latency_seconds_count",
    ):
        assert value(after, name) == value(before, name), name
