"""Secrets a local user or an unauthenticated client must not read (issue 41, rows 5 and 6): the
Python backend's shared memory (every request's prompt and forwarded `authorization` header) is
0600, and with `paged-llm serve --api-key` no endpoint shows the key or any digest of it."""

from __future__ import annotations

import hashlib
import json
import os
import re
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
import tritonclient.grpc as grpcclient

from paged_llm.launcher.shm_regions import SHM_DIR, stub_regions
from paged_llm.testing.server_process import free_ports
from tests.e2e.client import make_inputs

API_KEY = "secrets-test-key-4f1c"
pytestmark = pytest.mark.timeout(600)


def _request(url: str, body: dict[str, Any] | None = None, key: str | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:  # not listening (yet)
        return 0, ""


def _private_regions(server_pid: int) -> dict[str, int]:
    """The permission bits of the shared-memory regions of the stubs below `server_pid`."""
    return {name: (SHM_DIR / name).stat().st_mode & 0o777 for name in stub_regions(server_pid)}


def test_the_stubs_shared_memory_and_the_server_log_are_private(server):
    """start_server's tritonserver: after a request (its prompt and parameters went through the
    region), every stub's region is 0600, not 0644 as boost::interprocess makes it."""
    body = {"text_input": "a private prompt", "max_tokens": 2, "authorization": "Bearer not-a-key"}
    status, answer = _request(f"http://{server.http_url}/v2/models/llm/generate", body)
    assert status == 200, answer
    modes = _private_regions(server.process.pid)
    assert modes and set(modes.values()) == {0o600}, {name: oct(mode) for name, mode in modes.items()}
    assert server.log_path.stat().st_mode & 0o777 == 0o600


@dataclass
class Served:
    process: subprocess.Popen
    port: int
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: Path
    log_path: Path

    def tritonserver_pid(self) -> int:
        [pid] = [
            child.pid
            for child in psutil.Process(self.process.pid).children(recursive=True)
            if child.name() == "tritonserver"
        ]
        return pid


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Served]:
    """`paged-llm serve --api-key` on the tiny model."""
    root = tmp_path_factory.mktemp("secrets")
    port, http_port, grpc_port, metrics_port = free_ports(4)
    log_path = root / "serve.log"
    command = [
        sys.executable, "-m", "paged_llm.cli", "serve", "tiny-qwen3",
        "--port", str(port), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--model-repository-dir", str(root / "models"),
        "--api-key", API_KEY, "--openai-workers", "1",
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    running = Served(process, port, http_port, grpc_port, metrics_port, root / "models", log_path)
    try:
        deadline = time.monotonic() + 240
        while _request(f"http://127.0.0.1:{port}/health")[0] != 200:
            log_tail = log_path.read_text()[-4000:]
            assert process.poll() is None, f"exited with {process.returncode}:\n{log_tail}"
            assert time.monotonic() < deadline, f"not healthy:\n{log_tail}"
            time.sleep(0.25)
        yield running
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# What must appear nowhere: the key, and its SHA-256 (the digest config.pbtxt used to carry).
_SECRETS = (API_KEY, hashlib.sha256(API_KEY.encode()).hexdigest())
_DIGEST_LIKE = re.compile(r"[0-9a-fA-F]{64}")


def _assert_secret_free(where: str, text: str) -> None:
    for secret in _SECRETS:
        assert secret.lower() not in text.lower(), where
    assert "api_key" not in text.lower(), (where, text[:2000])


def test_no_endpoint_shows_the_api_key_or_a_digest_of_it(served):
    triton = f"http://127.0.0.1:{served.http_port}"
    status, config_text = _request(f"{triton}/v2/models/llm/config")  # open: no key needed
    assert status == 200, config_text
    parameters = json.loads(config_text)["parameters"]
    assert "model" in parameters  # the engine's settings are there, no key material
    for name, value in parameters.items():
        assert not _DIGEST_LIKE.search(value["string_value"]), name
    texts = {"HTTP llm config": config_text}
    for path in ("/v2", "/v2/models/llm", "/v2/models/llm_trtllm/config", "/v2/models/stats"):
        status, texts[f"HTTP {path}"] = _request(f"{triton}{path}")
        assert status == 200, (path, texts[f"HTTP {path}"])
    status, texts["HTTP repository index"] = _request(f"{triton}/v2/repository/index", {})
    assert status == 200
    texts["metrics"] = _request(f"http://127.0.0.1:{served.metrics_port}/metrics")[1]
    status, texts["OpenAI /v1/models"] = _request(f"http://127.0.0.1:{served.port}/v1/models", key=API_KEY)
    assert status == 200
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    try:
        grpc_config = client.get_model_config("llm", as_json=True)
        texts["gRPC llm config"] = json.dumps(grpc_config)
        assert "model" in grpc_config["config"]["parameters"]
        texts["gRPC metadata"] = json.dumps(client.get_model_metadata("llm", as_json=True))
        texts["gRPC repository index"] = json.dumps(client.get_model_repository_index(as_json=True))
        texts["gRPC statistics"] = json.dumps(client.get_inference_statistics(as_json=True))
    finally:
        client.close()
    for path in served.repository.rglob("config.pbtxt"):  # the files those answers come from
        texts[str(path)] = path.read_text()
    # and the server's command line, which `ps` shows every user
    texts["tritonserver cmdline"] = Path(f"/proc/{served.tritonserver_pid()}/cmdline").read_bytes().decode()
    for where, text in texts.items():
        _assert_secret_free(where, text)


def _grpc_stream(port: int, headers: dict[str, str] | None) -> tuple[str, str | None]:
    """One streamed request to Triton's gRPC port: (text, error message)."""
    import queue

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    client.async_stream_infer("llm", make_inputs("Hi", stream=True, sampling_parameters={"max_tokens": 3}),
                              enable_empty_final_response=True)  # fmt: skip
    text, error_message = "", None
    try:
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                error_message = str(error)
                break
            text += "".join(t.decode() for t in (result.as_numpy("text_output") or []))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return text, error_message


def test_the_key_still_guards_every_api_and_the_regions_are_private(served):
    """The llm model checks keys against the verifier in its environment: the right key works on
    the OpenAI API, HTTP generate and gRPC streaming; a wrong or missing one gets the per-request
    error; the server keeps serving. `paged-llm serve`'s stubs' regions are 0600 too."""
    generate = f"http://127.0.0.1:{served.http_port}/v2/models/llm/generate"
    body = {"text_input": "Hi", "max_tokens": 3}
    for bad in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {API_KEY}"}):
        status, answer = _request(generate, {**body, **bad})
        assert status == 400 and "authorization: missing or wrong API key" in answer, answer
    for _ in range(2):  # the first checks the key (scrypt), the second finds it remembered
        status, answer = _request(generate, {**body, "authorization": f"Bearer {API_KEY}"})
        assert status == 200 and json.loads(answer)["text_output"], answer
    text, error = _grpc_stream(served.grpc_port, None)
    assert error is not None and "authorization: missing or wrong API key" in error
    text, error = _grpc_stream(served.grpc_port, {"authorization": f"Bearer {API_KEY}"})
    assert error is None and text
    base_url = f"http://127.0.0.1:{served.port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
    chat = client.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    modes = _private_regions(served.tritonserver_pid())
    assert modes and set(modes.values()) == {0o600}, {name: oct(mode) for name, mode in modes.items()}
