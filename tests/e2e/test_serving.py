"""End-to-end: a real tritonserver with the llm model, reached through tritonclient and HTTP."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from paged_llm.paths import repo_root
from tests.e2e.client import http_post, make_inputs, sse_events, stream, stream_many
from tests.e2e.metrics import wait_for
from tests.e2e.server import make_model_repository, start_server

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def test_grpc_streaming_yields_several_responses_then_one_final(server):
    result = stream(server.grpc_url, "The capital of France is", stream=True, sampling_parameters=GREEDY)
    assert not result.errors
    assert result.finals == 1
    assert len(result.responses) >= 2
    assert result.text


def test_streamed_text_equals_non_streaming_text(server):
    prompt = "Streaming and non-streaming must agree:"
    streamed = stream(server.grpc_url, prompt, stream=True, sampling_parameters=GREEDY)
    whole = stream(
        server.grpc_url, prompt, stream=False, sampling_parameters=GREEDY, exclude_input_in_output=True
    )
    assert whole.finals == 1 and len(whole.responses) == 1
    assert streamed.text == whole.text
    streamed_ids = [i for r in streamed.responses for i in r.as_numpy("output_ids").tolist()]
    assert streamed_ids == whole.responses[0].as_numpy("output_ids").tolist()
    assert len(streamed_ids) == GREEDY["max_tokens"]


def test_non_streaming_echoes_prompt_unless_excluded(server):
    prompt = "Echo me"
    echoed = stream(server.grpc_url, prompt, sampling_parameters=GREEDY)
    excluded = stream(server.grpc_url, prompt, sampling_parameters=GREEDY, exclude_input_in_output=True)
    assert echoed.text == prompt + excluded.text


def test_concurrent_grpc_requests_match_sequential(server):
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(6)]
    sequential = [
        stream(server.grpc_url, p, sampling_parameters=GREEDY, exclude_input_in_output=True).text
        for p in prompts
    ]
    together = stream_many(
        server.grpc_url,
        [make_inputs(p, sampling_parameters=GREEDY, exclude_input_in_output=True) for p in prompts],
    )
    assert [r.finals for r in together] == [1] * len(prompts)
    assert [r.text for r in together] == sequential


def test_http_generate_returns_one_response(server):
    status, body = http_post(
        server.http_url,
        "/v2/models/llm/generate",
        {"text_input": "Hello", "max_tokens": 8, "temperature": 0, "return_finish_reason": True},
    )
    assert status == 200, body
    payload = json.loads(body)
    assert payload["text_output"].startswith("Hello")
    assert payload["finish_reason"] == "length"
    assert len(payload["output_ids"]) == 8


def test_http_generate_stream_streams(server):
    status, body = http_post(
        server.http_url,
        "/v2/models/llm/generate_stream",
        {
            "text_input": "Hello",
            "stream": True,
            "sampling_parameters": json.dumps(GREEDY),
            "return_finish_reason": True,
        },
    )
    assert status == 200, body
    events = sse_events(body)
    assert len(events) >= 2
    assert all("error" not in e for e in events)
    assert events[-1]["finish_reason"] == "length"
    streamed = "".join(e["text_output"] for e in events)
    status, body = http_post(
        server.http_url,
        "/v2/models/llm/generate",
        {"text_input": "Hello", "sampling_parameters": json.dumps(GREEDY), "exclude_input_in_output": True},
    )
    assert json.loads(body)["text_output"] == streamed


def test_bad_sampling_parameters_json_is_invalid_arg_and_server_keeps_serving(server):
    status, body = http_post(
        server.http_url, "/v2/models/llm/generate", {"text_input": "Hi", "sampling_parameters": "{not json"}
    )
    assert status == 400, body
    assert "sampling_parameters" in json.loads(body)["error"]
    bad = stream(server.grpc_url, "Hi", sampling_parameters="{not json")
    assert bad.finals == 1 and len(bad.errors) == 1
    assert "sampling_parameters: invalid JSON" in bad.errors[0]
    good = stream(server.grpc_url, "Hi", sampling_parameters=GREEDY)
    assert not good.errors and good.finals == 1 and good.text


def test_metrics_count_successful_requests(tmp_path):
    """On a server of its own: on the shared one, Triton records earlier tests' requests late under
    load (seen in .ci/run on a busy machine: 5 counted for 3, after the counter had settled)."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    own = start_server(repository, tmp_path / "server.log")

    def successes() -> float:
        match = re.search(r'nv_inference_request_success\{model="llm",version="1"\} (\d+)', own.metrics())
        assert match, "no success counter for llm"
        return float(match.group(1))

    try:
        assert successes() == 0
        for _ in range(3):
            assert stream(own.grpc_url, "count me", sampling_parameters=GREEDY).finals == 1
        assert wait_for(lambda: successes() >= 3, timeout_s=30)
        time.sleep(1.0)  # nothing else arrives
        assert successes() == 3
    finally:
        own.stop()


def test_client_cli_streams_over_grpc_and_http(server):
    script = repo_root() / "clients" / "generate.py"
    for extra in (["--url", server.grpc_url], ["--http", "--url", server.http_url]):
        completed = subprocess.run(
            [sys.executable, str(script), "Tell me a story", "--max-tokens", "12", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.strip()
        assert "finish_reason: length" in completed.stderr
        assert completed.stderr.count("finish_reason") == 1  # not "None" after every token


def test_serving_benchmark_mixed_sends_half_the_streams_through_the_openai_server(tmp_path):
    """--endpoint mixed: direct gRPC and the OpenAI server it starts (streams over Triton's HTTP
    generate_stream) in one run, each half's figures and the difference in the JSON."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    out = tmp_path / "bench.json"
    completed = subprocess.run(
        [
            sys.executable, str(repo_root() / "scripts" / "bench_serving.py"), "--launch", str(repository),
            "--endpoint", "mixed", "--openai-workers", "1", "--client-processes", "2",
            "--scenario", "mixed:8:16:4:c=4", "--json", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["endpoint"] == "mixed"
    for half in ("served", "served_openai"):  # the 8 requests split between the two client processes
        assert result[half]["num_requests"] == 4 and result[half]["num_errors"] == 0
        assert result[half]["output_tokens"] == 4 * 4
    assert set(result["openai_added"]) >= {"ttft_p50_ms", "itl_p50_ratio"}
    assert "OpenAI path adds (same run)" in completed.stdout


def test_serving_benchmark_runs_served_and_offline_and_writes_its_json(tmp_path):
    """scripts/bench_serving.py end to end on the tiny model: its own tritonserver (--launch), the
    offline engine on the same requests, and the server-side TTFT read from /metrics. Timings are
    not checked (they belong to benchmarks); counts and the JSON's shape are."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    out = tmp_path / "bench.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(repo_root() / "scripts" / "bench_serving.py"),
            "--launch",
            str(repository),
            "--compare-offline",
            "--client-processes",
            "2",
            "--scenario",
            "smoke:6:16:5:c=2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    for side in ("served", "offline"):
        assert result[side]["num_requests"] == 6 and result[side]["num_errors"] == 0
        assert result[side]["output_tokens"] == 6 * 5
    assert result["served"]["server_ttft_mean_ms"] > 0
    assert result["served_over_offline"] > 0
    assert "served / offline" in completed.stdout
