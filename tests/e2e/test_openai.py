"""The OpenAI-compatible server end to end: `paged-llm serve` on the tiny model (real tritonserver,
real OpenAI server process), driven by the official `openai` SDK and by raw HTTP for what the SDK
would refuse to send."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from paged_llm.launcher.repository import make_model_repository
from paged_llm.testing.server_process import free_ports, start_server, stop_process_group, wait_until_healthy
from tests.e2e.metrics import value, wait_for

API_KEY = "test-key-123"
pytestmark = pytest.mark.timeout(600)


@dataclass
class Served:
    process: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path
    http_port: int = 0
    grpc_port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def triton_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), dict(error.headers)
    except OSError:  # not listening (yet)
        return 0, "", {}


def post(
    base_url: str, path: str, body: bytes | dict[str, Any], key: str | None = API_KEY
) -> tuple[int, Any, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{base_url}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            status, response_headers = response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        text, status, response_headers = (
            error.read().decode(),
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
        )
    try:
        return status, json.loads(text), response_headers
    except json.JSONDecodeError:
        return status, text, response_headers


def _start_openai_server(grpc_url: str, log_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """The OpenAI server alone (python -m paged_llm.openai, no keys) in front of `grpc_url`, once
    healthy: (process, base URL). The caller stops it (stop_process_group)."""
    [port] = free_ports(1)
    with open(log_path, "w") as log:
        openai_server = subprocess.Popen(
            [sys.executable, "-m", "paged_llm.openai", "--triton-url", grpc_url,
             "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{base_url}/health", openai_server, log_path)
    except BaseException:
        stop_process_group(openai_server, signal.SIGKILL, timeout_s=10)
        raise
    return openai_server, base_url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("openai")
    port, http_port, grpc_port, metrics_port = free_ports(4)
    log_path = root / "serve.log"
    command = [
        sys.executable, "-m", "paged_llm.cli", "serve", "tiny-qwen3",
        "--port", str(port), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--model-repository-dir", str(root / "models"),
        "--api-key", API_KEY, "--openai-workers", "2",  # /metrics then sums two processes
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    running = Served(process, port, metrics_port, log_path, http_port, grpc_port)
    try:
        wait_until_healthy(f"{running.base_url}/health", process, log_path)
        yield running
    finally:
        stop_process_group(process)


def test_completions_and_chat_streaming_and_not_agree_and_count_tokens(served, tiny_tokenizer):
    client = served.client()
    prompt = "The capital of France is"
    whole = client.completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    [choice] = whole.choices
    streamed = list(
        client.completions.create(
            model="llm",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[-1].usage == whole.usage and not streamed[-1].choices
    # usage: the engine's own counts (a completions prompt with the tokenizer's special tokens, as vLLM)
    assert whole.usage.prompt_tokens == len(tiny_tokenizer(prompt)["input_ids"])
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens) == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert choice.finish_reason == "length" and "".join(choice.logprobs.tokens) == choice.text

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more"}]},
    ]
    chat = client.chat.completions.create(model="llm", messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="llm", messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    rendered = tiny_tokenizer.apply_chat_template(
        # the parts joined by a newline, as vLLM joins them
        [{**m, "content": "Tell me\nmore"} if isinstance(m["content"], list) else m for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat.usage.prompt_tokens == len(tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert chat.usage.completion_tokens == 10 and chunks[-1].usage == chat.usage


def test_n_stop_seed_echo_and_several_prompts(served):
    client = served.client()
    two = client.completions.create(
        model="llm", prompt="Once upon", max_tokens=8, n=2, seed=11, temperature=1.0
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text != two.choices[1].text  # samples of one request get their own seeds
    assert two.usage.completion_tokens == 16
    again = client.completions.create(
        model="llm", prompt="Once upon", max_tokens=8, n=2, seed=11, temperature=1.0
    )
    assert [c.text for c in again.choices] == [c.text for c in two.choices]  # seed: reproducible
    streamed = list(
        client.completions.create(
            model="llm", prompt="Once upon", max_tokens=8, n=2, seed=11, temperature=1.0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts, reasons = ["", ""], [None, None]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in two.choices] and reasons == ["length", "length"]
    assert streamed[-1].usage == two.usage  # counted from the final response's totals
    other = client.completions.create(
        model="llm", prompt="Once upon", max_tokens=8, n=2, seed=12, temperature=1.0
    )
    assert [c.text for c in other.choices] != [c.text for c in two.choices]

    greedy = client.completions.create(model="llm", prompt="A B C", max_tokens=16, temperature=0).choices[0]
    stop = greedy.text[len(greedy.text) // 2 :][:3]
    assert stop.strip(), greedy.text
    stopped = client.completions.create(
        model="llm", prompt="A B C", max_tokens=16, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy.text[: greedy.text.index(stop)]

    echoed = client.completions.create(
        model="llm", prompt=["x y", "z"], max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in echoed.choices] == [0, 1]
    assert echoed.choices[0].text.startswith("x y") and echoed.choices[1].text.startswith("z")
    by_ids = client.completions.create(model="llm", prompt=[[1, 2, 3]], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 3 and by_ids.usage.completion_tokens == 3


def test_logprobs_have_the_asked_number_of_alternatives(served):
    client = served.client()
    chat = client.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        alternatives = [t.logprob for t in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == pytest.approx(alternatives[0], abs=1e-4)  # greedy: the most likely one
        assert entry.bytes == list(entry.token.encode())
    completion = client.completions.create(model="llm", prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) in (1, 2) for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]


def test_each_worker_listens_on_its_own_socket(served):
    """--openai-workers 2: two processes, each with its own SO_REUSEPORT listening socket (so the
    kernel spreads connections over them, where one shared socket let one process take most)."""
    listeners = {
        (process.pid, conn.fd)
        for process in psutil.Process(served.process.pid).children(recursive=True)
        for conn in process.net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == served.port
    }
    assert len({pid for pid, _ in listeners}) == 2, listeners
    assert len(listeners) == 2, listeners


def test_keys_models_health_version_and_metrics(served):
    with pytest.raises(openai.AuthenticationError):
        served.client("wrong").models.list()
    status, body, headers = post(
        served.base_url, "/v1/completions", {"model": "llm", "prompt": "x"}, key=None
    )
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert headers.get("www-authenticate") == "Bearer"
    assert _get(f"{served.base_url}/health")[0] == 200  # open without a key
    assert _get(f"{served.base_url}/metrics")[0] == 401
    # only the models with vllm_backend's interface (not llm_trtllm, ensemble, tensorrt_llm_bls)
    assert [m.id for m in served.client().models.list().data] == ["llm"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client().completions.create(model="ensemble", prompt="x")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client().completions.create(model="no-such-model", prompt="x")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, text, _ = _get(f"{served.base_url}/version", auth)
    assert status == 200 and json.loads(text)["triton_version"] == "2.51.0"
    assert _get(f"{served.base_url}/metrics", auth)[0] == 200
    served.client().completions.create(model="llm", prompt="counted", max_tokens=2)  # one 200 at least

    def counted() -> bool:  # each worker publishes its figures every second; any one answers
        text = _get(f"{served.base_url}/metrics", auth)[1]
        return (
            value(text, "paged_llm_openai_requests_total", route="completions", status="200") >= 1
            and value(text, "paged_llm_openai_requests_total", route="completions", status="404") >= 1
            and value(text, "paged_llm_openai_requests_total", route="completions", status="401") == 0
            and value(text, "paged_llm_openai_time_to_first_token_seconds_count", route="completions") >= 0
            and value(text, "paged_llm_openai_requests_in_flight") == 0
        )

    assert wait_for(counted, timeout_s=30), _get(f"{served.base_url}/metrics", auth)[1]


def _triton_grpc_stream(port: int, headers: dict[str, str] | None) -> tuple[str, str | None]:
    """One streamed request straight to Triton's gRPC port: (text, error message)."""
    import queue

    import tritonclient.grpc as grpcclient

    from tests.e2e.client import make_inputs

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    client.async_stream_infer("llm", make_inputs("Hi", stream=True, sampling_parameters={"max_tokens": 3}),
                              enable_empty_final_response=True)  # fmt: skip
    text, error_message = "", None
    while True:
        result, error = results.get(timeout=60)
        if error is not None:
            error_message = str(error)
            break
        text += "".join(t.decode() for t in (result.as_numpy("text_output") or []))
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return text, error_message


def test_the_same_keys_guard_inference_on_tritons_own_ports(served):
    """`paged-llm serve --api-key` has Triton forward the authorization header to the llm model,
    which checks it: llm and llm_trtllm (whose BLS request to llm carries it on) over HTTP generate,
    and gRPC streaming with the header."""
    generate = f"http://127.0.0.1:{served.http_port}/v2/models"
    for model, body in (("llm", {"text_input": "Hi", "max_tokens": 3}),
                        ("llm_trtllm", {"text_input": "Hi", "max_tokens": 3})):  # fmt: skip
        status, answer, _ = post(generate, f"/{model}/generate", body, key=None)
        assert status == 400 and "authorization: missing or wrong API key" in answer["error"], (model, answer)
        # Triton 2.51 forwards no header on HTTP generate (triton-inference-server/server#8790): the
        # key goes in the body, whose unknown top-level keys become request parameters.
        wrong = {**body, "authorization": "Bearer wrong"}
        status, answer, _ = post(generate, f"/{model}/generate", wrong, key=None)
        assert status == 400 and "authorization" in answer["error"], (model, answer)
        good = {**body, "authorization": f"Bearer {API_KEY}"}
        status, answer, _ = post(generate, f"/{model}/generate", good, key=None)
        assert status == 200 and answer["text_output"], (model, answer)
    text, error = _triton_grpc_stream(served.grpc_port, None)
    assert error is not None and "authorization: missing or wrong API key" in error
    text, error = _triton_grpc_stream(served.grpc_port, {"authorization": f"Bearer {API_KEY}"})
    assert error is None and text
    assert _get(f"http://127.0.0.1:{served.http_port}/v2/health/ready")[0] == 200  # health stays open


MALFORMED: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": "llm"}, "prompt"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "foo": 1}, "foo"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "temperature": 5}, "temperature"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "stream": "maybe"}, "stream"),
    ("/v1/completions", {"model": "llm", "prompt": ""}, "prompt"),  # found by the engine
    ("/v1/completions", {"model": "llm", "prompt": [[999999999]]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"model": "llm", "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": "x", "stream": True, "max_tokens": 100000}, "max_tokens"),
    ("/v1/chat/completions", {"model": "llm", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "llm", "messages": [{"role": "bot", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "llm", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions",
     {"model": "llm", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "llm", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     "tools[0].type"),
    # prompt + max_tokens past the 4,096-token context: refused, as OpenAI and vLLM do (not cut short)
    ("/v1/completions", {"model": "llm", "prompt": "Hello there", "max_tokens": 4095}, "max_tokens"),
    ("/v1/chat/completions",
     {"model": "llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4090}, "max_tokens"),
]  # fmt: skip


def test_x_session_id_makes_requests_turns_of_one_session(served):
    """X-Session-Id (+ X-Session-Start / X-Session-End): each request carries only its turn's new
    tokens and continues the conversation: the same texts as the same session driven on Triton's
    own HTTP port (where a session equals stateless requests: tests/e2e/test_sessions.py)."""
    client = served.client()
    turns = [[101, 102, 103, 104, 105], [106, 107], [108, 109, 110]]
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    texts, triton_texts = [], []
    generate = f"http://127.0.0.1:{served.http_port}/v2/models"
    for index, new in enumerate(turns):
        flags = {"start": index == 0, "end": index == len(turns) - 1}
        headers = {"X-Session-Id": "openai-chat"}
        headers.update({f"X-Session-{k.title()}": "true" for k, on in flags.items() if on})
        answer = client.completions.create(
            model="llm", prompt=new, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
            extra_headers=headers,
        )  # fmt: skip
        texts.append(answer.choices[0].text)
        body = {
            "input_ids": new, "sampling_parameters": json.dumps(greedy), "exclude_input_in_output": True,
            "session_id": "triton-chat", "session_start": flags["start"], "session_end": flags["end"],
            "authorization": f"Bearer {API_KEY}",
        }  # fmt: skip
        status, reply, _ = post(generate, "/llm/generate", body, key=None)
        assert status == 200, reply
        triton_texts.append(reply["text_output"])
    assert texts == triton_texts
    with pytest.raises(openai.NotFoundError, match="session 'openai-chat' is not open"):
        client.completions.create(
            model="llm", prompt="again", max_tokens=2, extra_headers={"X-Session-Id": "openai-chat"}
        )
    with pytest.raises(openai.BadRequestError, match="x-session-start: must be true or false"):
        client.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_headers={"X-Session-Id": "c", "X-Session-Start": "maybe"},
        )  # fmt: skip


def test_malformed_bodies_get_400_in_openai_shape_and_the_server_keeps_serving(served):
    assert len(MALFORMED) >= 15
    for path, body, param in MALFORMED:
        status, answer, _ = post(served.base_url, path, body)
        assert status == 400, (body, answer)
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (body, answer)
        if param is not None:
            assert error["param"] == param, (body, answer)
    # A body over the cap (16 MiB by default) is refused from its Content-Length, before it is read.
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    connection.putrequest("POST", "/v1/completions")
    for name, header in (("Content-Type", "application/json"), ("Content-Length", str(17 << 20)),
                         ("Authorization", f"Bearer {API_KEY}")):  # fmt: skip
        connection.putheader(name, header)
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "limit" in json.loads(response.read())["error"]["message"]
    connection.close()
    ok = served.client().completions.create(model="llm", prompt="still serving", max_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_nulls_mean_defaults_and_openais_bookkeeping_fields_are_accepted(served):
    """What the SDK sends for a None it is given, and OpenAI fields that ask nothing of generation;
    GET /v1/models/{id}; with include_usage every chunk carries usage (null but in the last)."""
    client = served.client()
    completion = client.completions.create(
        model="llm", prompt="Hi", max_tokens=3, n=None, stream=None, echo=None, logprobs=None,
        extra_body={"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "priority": -1},
    )  # fmt: skip
    assert len(completion.choices) == 1 and completion.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="llm", max_tokens=2, logprobs=None, n=None, stream=None,
        messages=[{"role": "user", "content": [{"type": "text", "text": t} for t in ("a", "b")]}],
    )  # fmt: skip
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens == 2
    assert client.models.retrieve("llm").id == "llm"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    status, answer, _ = post(
        served.base_url, "/v1/completions",
        {"model": "llm", "prompt": "Hi", "max_tokens": 2, "stream": True,
         "stream_options": {"include_usage": None}},
    )  # fmt: skip
    assert status == 200, answer
    chunks = list(client.completions.create(model="llm", prompt="Hi", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    events = _sse_json(served.base_url, {"model": "llm", "prompt": "Hi", "max_tokens": 3, "stream": True,
                                         "stream_options": {"include_usage": True}})  # fmt: skip
    assert all("usage" in event for event in events) and events[-1]["usage"]["completion_tokens"] == 3


def _sse_json(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed completion's events as JSON (the raw stream, not the SDK's reading of it)."""
    request = urllib.request.Request(
        f"{base_url}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_sixty_four_concurrent_streams_all_complete(served):
    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": f"stream {index}"}], max_tokens=8, stream=True,
            stream_options={"include_usage": True}, seed=index,
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return text, usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        client = served.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 64 and all(tokens == 8 for _, tokens in results)


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "waiting-for-the-whole-answer"])
def test_a_client_that_goes_away_frees_its_kv_blocks(served, stream):
    def cancelled() -> float:
        return value(served.triton_metrics(), "paged_llm_final_responses_total", code="cancelled")

    def running() -> float:
        return value(served.triton_metrics(), "paged_llm_num_requests_running")

    assert wait_for(lambda: running() == 0)  # what earlier tests sent has ended (and been counted)
    cancelled_before = cancelled()
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    body = {"model": "llm", "prompt": "long story", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    connection.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        events = 0
        while events < 5:
            events += response.readline().startswith(b"data:")
    else:  # nothing comes back before the end: leave once the engine runs it
        assert wait_for(lambda: running() == 1)
    connection.close()  # 3000 tokens asked for, a few generated

    def freed() -> bool:
        text = served.triton_metrics()
        return (
            value(text, "paged_llm_kv_cache_usage_ratio") == 0.0
            and value(text, "paged_llm_num_requests_running") == 0
            and value(text, "paged_llm_final_responses_total", code="cancelled") > cancelled_before
        )

    assert wait_for(freed, timeout_s=60), served.triton_metrics()[-3000:]


# ----------------------------------------------------------------------------------- admission
@pytest.fixture(scope="module")
def admission(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[tuple[Any, str]]:
    """One tritonserver with two copies of llm (max_num_seqs=1): llm_reject (admission_policy reject)
    and llm_wait (queue_max_wait_s=0.5), and an OpenAI server (no keys) in front, streaming over
    Triton's HTTP generate_stream as `paged-llm serve` has it."""
    root = tmp_path_factory.mktemp("admission")
    repository = root / "models"
    for name, parameters in (
        ("llm_reject", {"max_num_seqs": "1", "admission_policy": "reject"}),
        ("llm_wait", {"max_num_seqs": "1", "queue_max_wait_s": "0.5"}),
    ):
        make_model_repository(root / f"staging_{name}", parameters, models=("llm",))
        repository.mkdir(exist_ok=True)
        shutil.move(root / f"staging_{name}" / "llm", repository / name)
    server = start_server(repository, root / "server.log")
    try:  # the server stops even if the OpenAI server never becomes healthy
        openai_server, base_url = _start_openai_server(
            server.grpc_url, root / "openai_server.log", "--health-model", "llm_reject",
            "--triton-http-url", server.http_url,
        )  # fmt: skip
        try:
            yield server, base_url
        finally:
            stop_process_group(openai_server, signal.SIGTERM)
    finally:
        server.stop()


def _open_long_stream(base_url: str, model: str) -> tuple[http.client.HTTPConnection, Any]:
    """A streaming request that holds the model's only slot until closed (its first event read)."""
    connection = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=120)
    body = {"model": model, "prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    connection.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"data:"):
        pass
    return connection, response


def test_admission_policy_reject_answers_503_with_retry_after_and_runs_nothing(admission):
    server, base_url = admission
    labels = {"model": "llm_reject"}
    generated_at_start = value(server.metrics(), "paged_llm_generation_tokens_total", **labels)
    connection, _ = _open_long_stream(base_url, "llm_reject")
    try:
        # The stub refreshes its metrics every 0.5 s: read them once they show the long stream
        # running and its first token counted (its prompt tokens are counted with that token, so
        # the prompt counter no longer moves for it).
        def long_stream_counted() -> bool:
            text = server.metrics()
            return (
                value(text, "paged_llm_num_requests_running", **labels) == 1
                and value(text, "paged_llm_generation_tokens_total", **labels) > generated_at_start
            )

        assert wait_for(long_stream_counted)
        before = server.metrics()
        status, answer, headers = post(
            base_url, "/v1/completions", {"model": "llm_reject", "prompt": "x"}, None
        )
        assert status == 503, answer
        assert "at capacity" in answer["error"]["message"] and headers.get("retry-after") == "1"

        def refused(text: str) -> float:
            return value(text, "paged_llm_final_responses_total", code="unavailable", **labels)

        assert wait_for(lambda: refused(server.metrics()) > refused(before))
        after = server.metrics()  # as of the refusal: it added no prompt tokens, it never ran
        for name in ("paged_llm_prompt_tokens_total", "paged_llm_num_requests_running"):
            assert value(after, name, **labels) == value(before, name, **labels), name
    finally:
        connection.close()

    def accepted_again() -> bool:
        body = {"model": "llm_reject", "prompt": "x", "max_tokens": 2}
        return post(base_url, "/v1/completions", body, None)[0] == 200

    assert wait_for(accepted_again, timeout_s=60)


def test_queue_max_wait_ends_a_request_that_never_started_with_503(admission):
    server, base_url = admission
    connection, _ = _open_long_stream(base_url, "llm_wait")
    try:
        status, answer, headers = post(
            base_url, "/v1/completions", {"model": "llm_wait", "prompt": "y"}, key=None
        )
        assert status == 503, answer
        assert "queue_max_wait_s=0.5" in answer["error"]["message"] and headers.get("retry-after") == "1"
        assert wait_for(  # the stub refreshes its metrics every 0.5 s
            lambda: (
                value(
                    server.metrics(), "paged_llm_final_responses_total", model="llm_wait", code="unavailable"
                )
                >= 1
            )
        )
    finally:
        connection.close()


@pytest.fixture(scope="module")
def grpc_transport(admission, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second OpenAI server on the admission fixture's tritonserver, streaming over gRPC."""
    server, _ = admission
    log_path = tmp_path_factory.mktemp("grpc_transport") / "openai_server.log"
    openai_server, base_url = _start_openai_server(server.grpc_url, log_path, "--health-model", "llm_reject")
    try:
        yield base_url
    finally:
        stop_process_group(openai_server, signal.SIGTERM)


def test_sampling_defaults_come_from_the_checkpoints_generation_config(admission, tmp_path, tiny_model_dir):
    """As vLLM's OpenAI server by default: a checkpoint whose generation_config.json says temperature 0
    makes a request that sets no temperature greedy (the engine's own default is 1)."""
    server, _ = admission
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, checkpoint / name)
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    openai_server, base_url = _start_openai_server(
        server.grpc_url,
        tmp_path / "openai_server.log",
        "--health-model",
        "llm_wait",
        "--tokenizer",
        str(checkpoint),
    )
    try:
        client = openai.OpenAI(api_key="unused", base_url=f"{base_url}/v1", max_retries=0)
        texts = [
            client.completions.create(model="llm_wait", prompt="defaults", max_tokens=12, **extra)
            .choices[0]
            .text
            for extra in ({}, {}, {"temperature": 0})
        ]
        assert texts[0] == texts[1] == texts[2], texts
        assert (
            "default sampling parameters from its generation_config.json"
            in (tmp_path / "openai_server.log").read_text()
        )
    finally:
        stop_process_group(openai_server, signal.SIGTERM)


def test_both_transports_stream_the_same_tokens_and_cancel_a_client_that_left(admission, grpc_transport):
    server, http_transport = admission
    labels = {"model": "llm_wait"}

    def cancelled() -> float:
        return value(server.metrics(), "paged_llm_final_responses_total", code="cancelled", **labels)

    def running() -> float:
        return value(server.metrics(), "paged_llm_num_requests_running", **labels)

    texts, usages = {}, {}
    for name, base_url in (("http", http_transport), ("grpc", grpc_transport)):
        client = openai.OpenAI(api_key="unused", base_url=f"{base_url}/v1", max_retries=0)
        stream = client.completions.create(
            model="llm_wait", prompt="the same prompt", max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        texts[name] = "".join(c.choices[0].text for c in chunks if c.choices)
        usages[name] = chunks[-1].usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert wait_for(lambda: running() == 0)
        before = cancelled()
        connection, _ = _open_long_stream(base_url, "llm_wait")  # 3000 tokens asked for
        connection.close()
        assert wait_for(lambda before=before: cancelled() > before and running() == 0, timeout_s=60), name
    assert texts["http"] == texts["grpc"] and texts["http"]
    assert usages == {"http": 12, "grpc": 12}


def test_paged_llm_serve_stops_everything_on_ctrl_c(served, tmp_path):
    """A second `paged-llm serve` (no keys), stopped like Ctrl-C: SIGINT to its process group."""
    port, http_port, grpc_port, metrics_port = free_ports(4)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "paged_llm.cli", "serve", "--port", str(port),
             "--http-port", str(http_port), "--grpc-port", str(grpc_port),
             "--metrics-port", str(metrics_port),
             "--model-repository-dir", str(tmp_path / "models")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{base_url}/health", process, log_path)
        # The launcher prints its URLs once it saw the OpenAI server healthy too (it polls as well).
        assert wait_for(lambda: "curl -s http://127.0.0.1:" in log_path.read_text(), timeout_s=30)
        chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, answer, _ = post(base_url, "/v1/chat/completions", chat, None)
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert len(descendants) >= 3  # tritonserver, a stub, the OpenAI server (and the engine core)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        _gone, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:  # a failure above must not leave the launcher, tritonserver and the stubs running
        stop_process_group(process, signal.SIGKILL, timeout_s=10)


def test_health_turns_503_when_the_llm_stub_dies(tmp_path, tiny_model_dir):
    """Triton 2.51 keeps a model READY after its Python stub was killed (issue "Hardening" row 2):
    /health of the OpenAI server probes the model and says 503 then."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    server = start_server(repository, tmp_path / "server.log")
    log_path = tmp_path / "openai_server.log"
    openai_server = None
    try:
        openai_server, base_url = _start_openai_server(server.grpc_url, log_path)
        stubs = [
            p for p in psutil.Process(server.process.pid).children() if p.name().startswith("triton_python_b")
        ]
        assert len(stubs) == 1
        stubs[0].kill()

        def stub_gone() -> bool:  # Triton may leave it a zombie
            try:
                return stubs[0].status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        assert wait_for(stub_gone, timeout_s=30)
        assert server.is_ready()  # Triton still says so
        assert wait_for(lambda: _get(f"{base_url}/health")[0] == 503, timeout_s=60), log_path.read_text()[
            -2000:
        ]
    finally:
        if openai_server is not None:
            stop_process_group(openai_server, signal.SIGTERM)
        server.stop()


def test_a_restarted_tritonserver_is_served_again_from_its_first_request(tmp_path, tiny_model_dir):
    """tritonserver stopped and started again on its ports under a running OpenAI server: while it
    is down every request is a 503 in OpenAI's shape; once it is ready again the first requests
    succeed, streamed (HTTP generate_stream, pooled connections to the old server) and not (gRPC,
    whose channel would otherwise be waiting out its reconnection backoff)."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    server = start_server(repository, tmp_path / "server1.log")
    openai_server = None
    streamed = {"model": "llm", "prompt": "again", "max_tokens": 3, "stream": True, "ignore_eos": True}
    plain = {**streamed, "stream": False}

    def completion(body: dict[str, Any]) -> tuple[int, Any]:
        status, answer, _ = post(base_url, "/v1/completions", body, None)
        return status, answer

    try:
        openai_server, base_url = _start_openai_server(
            server.grpc_url, tmp_path / "openai_server.log", "--triton-http-url", server.http_url
        )
        assert completion(streamed)[0] == 200 and completion(plain)[0] == 200
        ports = server.ports
        server.stop()
        for _ in range(2):  # a few seconds down: the gRPC channel's reconnection attempts fail meanwhile
            for body in (streamed, plain):
                status, answer = completion(body)
                assert status == 503, answer
                assert "cannot reach tritonserver" in answer["error"]["message"]
                assert answer["error"]["type"] == "service_unavailable_error"
        assert _get(f"{base_url}/health")[0] == 503
        server = start_server(repository, tmp_path / "server2.log", ports=ports)
        status, answer = completion(plain)
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
        status, text = completion(streamed)
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
        assert wait_for(lambda: _get(f"{base_url}/health")[0] == 200, timeout_s=30)
    finally:
        if openai_server is not None:
            stop_process_group(openai_server, signal.SIGTERM)
        server.stop()


def _cold_tokenizer_load_s(tiny_model_dir: Path) -> float:
    """What the first chat request of a cold worker would pay here and now: importing transformers
    and loading the tiny model's tokenizer in a fresh process (3-6 s on the 2-core VM)."""
    code = (
        "import sys, time; start = time.monotonic(); from transformers import AutoTokenizer; "
        "AutoTokenizer.from_pretrained(sys.argv[1]).apply_chat_template("
        "[{'role': 'user', 'content': 'x'}], tokenize=False); print(time.monotonic() - start)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_health_says_200_only_once_every_worker_is_warm(tmp_path, tiny_model_dir):
    """Each OpenAI worker loads the tokenizer and renders the chat template before it listens
    (issue 41 row 9): the log says so for both workers, and right after /health first says 200 a
    chat request on a fresh connection takes less than half of what a cold load costs here."""
    cold_s = _cold_tokenizer_load_s(tiny_model_dir)
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    server = start_server(repository, tmp_path / "server.log")
    log_path = tmp_path / "openai_server.log"
    openai_server = None
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        openai_server, base_url = _start_openai_server(
            server.grpc_url, log_path, "--triton-http-url", server.http_url, "--workers", "2",
            "--log-level", "info",
        )  # fmt: skip
        start = time.monotonic()
        status, answer, _ = post(base_url, "/v1/chat/completions", chat, None)
        first_s = time.monotonic() - start
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
        assert "OpenAI server worker" in log_path.read_text()  # the one that answered warmed first
        assert first_s < cold_s / 2, (first_s, cold_s)

        def warm_workers() -> int:
            return len(re.findall(r"OpenAI server worker \d+ warm in", log_path.read_text()))

        assert wait_for(lambda: warm_workers() == 2, timeout_s=120), log_path.read_text()[-3000:]
        for _ in range(6):  # fresh connections: the kernel spreads them over both workers' sockets
            start = time.monotonic()
            assert post(base_url, "/v1/chat/completions", chat, None)[0] == 200
            assert time.monotonic() - start < cold_s / 2
    finally:
        if openai_server is not None:
            stop_process_group(openai_server, signal.SIGTERM)
        server.stop()


def test_streams_cut_by_a_killed_llm_stub_end_with_an_error_event_and_done(tmp_path):
    """kill -9 of the `llm` stub under `paged-llm serve` with streams in flight on both routes
    (issue 41 row 7): every stream ends with an error event in OpenAI's shape and `data: [DONE]`,
    as the openai SDK (an APIError, not a connection error) and a raw reader (the body's end)
    see it, and no client hangs."""
    import threading

    import httpx2

    port, http_port, grpc_port, metrics_port = free_ports(4)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "paged_llm.cli", "serve", "--port", str(port),
             "--http-port", str(http_port), "--grpc-port", str(grpc_port),
             "--metrics-port", str(metrics_port), "--model-repository-dir", str(tmp_path / "models"),
             "--instance-count", "1"],  # every stream on the one stub this test kills, on any host
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    long = {"max_tokens": 3500, "ignore_eos": True}
    streaming = threading.Semaphore(0)  # one release per stream that read its first event
    outcomes: dict[str, Any] = {}

    def sdk_stream(name: str, route: str) -> None:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            if route == "chat":
                stream = client.chat.completions.create(
                    model="llm", messages=[{"role": "user", "content": "go"}], stream=True, extra_body=long
                )
            else:
                stream = client.completions.create(model="llm", prompt="go", stream=True, extra_body=long)
            for index, _chunk in enumerate(stream):
                if index == 0:
                    streaming.release()
            outcomes[name] = "ended without an error"
        except BaseException as error:
            outcomes[name] = error

    def raw_stream(name: str, path: str, body: dict[str, Any]) -> None:
        lines: list[str] = []
        try:
            with httpx2.stream("POST", f"{base_url}{path}", json={**body, **long}, timeout=120) as response:
                for line in response.iter_lines():
                    if line and not lines:
                        streaming.release()
                    if line:
                        lines.append(line)
            outcomes[name] = lines
        except BaseException as error:
            outcomes[name] = error

    streams = [
        threading.Thread(target=sdk_stream, args=("sdk chat", "chat")),
        threading.Thread(target=sdk_stream, args=("sdk completions", "completions")),
        threading.Thread(
            target=raw_stream,
            args=(
                "raw chat",
                "/v1/chat/completions",
                {"model": "llm", "messages": [{"role": "user", "content": "go"}], "stream": True},
            ),
        ),
        threading.Thread(
            target=raw_stream,
            args=("raw completions", "/v1/completions", {"model": "llm", "prompt": "go", "stream": True}),
        ),
    ]
    try:
        wait_until_healthy(f"{base_url}/health", process, log_path)
        for thread in streams:
            thread.start()
        for _ in streams:  # every stream is past its first byte
            assert streaming.acquire(timeout=120), (outcomes, log_path.read_text()[-3000:])
        [stub] = [
            p
            for p in psutil.Process(process.pid).children(recursive=True)
            if p.name().startswith("triton_python_b") and "llm_0_0" in p.cmdline()
        ]
        stub.kill()
        for thread in streams:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in streams), (outcomes, log_path.read_text()[-3000:])
        for name in ("sdk chat", "sdk completions"):
            error = outcomes[name]
            assert isinstance(error, openai.APIError) and not isinstance(error, openai.APIConnectionError), (
                name, error,
            )  # fmt: skip
        for name in ("raw chat", "raw completions"):
            lines = outcomes[name]
            assert isinstance(lines, list), (name, lines)  # (not a read of a body cut off mid-way)
            assert lines[-1] == "data: [DONE]", (name, lines[-3:])
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    finally:
        stop_process_group(process, signal.SIGINT)
        for thread in streams:
            thread.join(timeout=30)


def test_a_worker_that_finds_no_tritonserver_listens_and_says_it_is_warming(tmp_path):
    """Warming up needs tritonserver (the model's config names its checkpoint): without one the
    worker does not wait for it to open its socket; /health says 503 warming meanwhile."""
    port, dead_port = free_ports(2)
    log_path = tmp_path / "openai_server.log"
    with open(log_path, "w") as log:
        openai_server = subprocess.Popen(
            [sys.executable, "-m", "paged_llm.openai", "--triton-url", f"127.0.0.1:{dead_port}",
             "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        assert wait_for(lambda: _get(f"http://127.0.0.1:{port}/health")[0] != 0, timeout_s=120), (
            log_path.read_text()[-2000:]
        )
        status, body, headers = _get(f"http://127.0.0.1:{port}/health")
        assert status == 503 and json.loads(body) == {"status": "warming"}
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
    finally:
        stop_process_group(openai_server, signal.SIGTERM)
