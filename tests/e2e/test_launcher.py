"""`paged-llm serve` as a whole, on the tiny model: no single request on any port it opens stops
the service (the HTTP guard in front of Triton's HTTP and metrics ports, launcher/http_guard.py), and
Triton's KServe HTTP clients work through the guard."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from paged_llm.testing.server_process import free_ports, http_status, stop_process_group, wait_until_healthy
from tests.e2e.server import live_children_named

pytestmark = pytest.mark.timeout(600)

FORM_BODY_BYTES = 4_200_000  # tritonserver 2.51 died of SIGSEGV from 4,199,992 form-encoded bytes


@dataclass
class Served:
    process: subprocess.Popen
    log_path: Path
    port: int
    http_port: int
    grpc_port: int
    metrics_port: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tritonserver(self) -> psutil.Process:
        [server] = live_children_named(self.process.pid, "tritonserver")
        return server


def start_served(root: Path, *args: str) -> Served:
    port, http_port, grpc_port, metrics_port = free_ports(4)
    log_path = root / "serve.log"
    command = [
        sys.executable, "-m", "paged_llm.cli", "serve", "tiny-qwen3",
        "--port", str(port), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--model-repository-dir", str(root / "models"),
        "--openai-workers", "1", *args,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(process, log_path, port, http_port, grpc_port, metrics_port)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}/health", process, log_path)
    except BaseException:
        stop_process_group(process)
        raise
    return served


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Served]:
    running = start_served(tmp_path_factory.mktemp("launcher"))
    try:
        yield running
    finally:
        stop_process_group(running.process)


def send_raw(port: int, head: bytes, body: bytes = b"", timeout_s: float = 30.0) -> bytes:
    """Sends one request as bytes; the first bytes of the answer, or b"" if the connection ended
    without one (what a crashed server, or a port that speaks no HTTP/1, does)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(head + body)
            return sock.recv(200)
        except OSError:
            return b""


def form_request(content_type: str | None, chunked: bool = False) -> tuple[bytes, bytes]:
    body = b"a" * FORM_BODY_BYTES
    head = b"POST /v2/models/llm/generate HTTP/1.1\r\nHost: x\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n".encode()
    if chunked:
        step = 1 << 16
        chunks = [
            b"%x\r\n%s\r\n" % (len(body[i : i + step]), body[i : i + step]) for i in range(0, len(body), step)
        ]
        return head + b"Transfer-Encoding: chunked\r\n\r\n", b"".join(chunks) + b"0\r\n\r\n"
    return head + f"Content-Length: {len(body)}\r\n\r\n".encode(), body


def generate(port: int, body: dict, path: str = "generate", content_type: str = "application/json"):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", f"/v2/models/llm/{path}", json.dumps(body), {"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_a_4_2_mb_form_encoded_body_on_any_port_stops_nothing(served):
    server = served.tritonserver()
    ports = (served.http_port, served.metrics_port, served.grpc_port, served.port)
    for port in ports:
        for content_type in (
            "application/x-www-form-urlencoded",
            "Application/X-WWW-Form-Urlencoded; charset=utf-8",
            "multipart/form-data; boundary=x",
            None,
        ):
            for chunked in (False, True):
                send_raw(port, *form_request(content_type, chunked))
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE, served.log()[-3000:]
    assert served.process.poll() is None
    status, text = generate(served.http_port, {"text_input": "Hello", "max_tokens": 2})
    assert status == 200 and "text_output" in text
    assert http_status(f"http://127.0.0.1:{served.metrics_port}/metrics") == 200
    assert http_status(f"http://127.0.0.1:{served.port}/health") == 200
    import tritonclient.grpc as grpcclient

    assert grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}").is_server_ready()
    assert served.tritonserver().pid == server.pid  # the same server, not a restarted one


def test_the_guard_answers_what_it_refuses_and_triton_answers_the_rest(served):
    # curl -d sends the form type: the guard drops it, so Triton reads the JSON as before.
    status, text = generate(
        served.http_port,
        {"text_input": "Hi", "max_tokens": 1},
        content_type="application/x-www-form-urlencoded",
    )
    assert status == 200 and "text_output" in text
    assert send_raw(served.http_port, *form_request("multipart/form-data; boundary=x")).startswith(
        b"HTTP/1.1 415"
    )
    too_large = b"POST /v2/models/llm/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"
    assert send_raw(served.http_port, too_large).startswith(b"HTTP/1.1 413")
    assert send_raw(served.metrics_port, too_large).startswith(b"HTTP/1.1 413")
    long_url = b"GET /v2/health/ready?" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert send_raw(served.http_port, long_url).startswith(b"HTTP/1.1 431")
    # Requests one after another on one kept-alive connection (Triton answers no pipelined ones).
    connection = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=30)
    for path in ("/v2/health/ready", "/v2/models/llm", "/v2/health/live"):
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        assert response.status == 200
    connection.close()


def test_kserve_http_clients_work_through_the_guard(served):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("llm")
    assert client.get_model_metadata("llm")["name"] == "llm"
    assert client.get_model_config("llm")["name"] == "llm"
    assert "model_stats" in client.get_inference_statistics("llm")
    client.close()
    status, text = generate(
        served.http_port, {"text_input": "Hello", "max_tokens": 3, "stream": True}, path="generate_stream"
    )
    events = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) == 3 and all("text_output" in event for event in events)


def _llm_stub(served: Served) -> psutil.Process:
    [stub] = [
        child
        for child in served.tritonserver().children()
        if child.name().startswith("triton_python_b")
        and any("/llm/1/model.py" in arg for arg in child.cmdline())
    ]
    return stub


def _wait_for(check, served: Served, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"{what} not within {timeout_s} s:\n{served.log()[-4000:]}")


def _serves_again(served: Served, old_server_pid: int) -> bool:
    try:
        if served.tritonserver().pid == old_server_pid:
            return False
    except (ValueError, psutil.Error):  # between two servers
        return False
    if http_status(f"http://127.0.0.1:{served.port}/health", 5) != 200:
        return False
    try:
        status, _ = generate(served.http_port, {"text_input": "again", "max_tokens": 2})
    except (OSError, http.client.HTTPException):  # the server went away meanwhile
        return False
    return status == 200


def test_a_dead_stub_or_a_crashed_server_is_restarted_until_the_budget_is_spent(tmp_path, tiny_model_dir):
    # one stub to kill, whatever the host (`paged-llm serve` starts three where a GPU serves)
    served = start_served(
        tmp_path, "--max-restarts", "2", "--restart-window-s", "600", "--instance-count", "1"
    )
    try:
        openai_side = [p for p in psutil.Process(served.process.pid).children() if p.name() != "tritonserver"]
        for kill in ("stub", "server"):
            old = served.tritonserver().pid
            victim = _llm_stub(served) if kill == "stub" else served.tritonserver()
            victim.kill()  # SIGKILL
            _wait_for(
                lambda old=old: _serves_again(served, old),
                served,
                90.0,
                f"served again after a killed {kill}",
            )
        assert served.log().count("restarting tritonserver") == 2
        assert [
            p for p in psutil.Process(served.process.pid).children() if p.name() != "tritonserver"
        ] == openai_side
        served.tritonserver().kill()  # a third death within the window: the launcher gives up
        served.process.wait(timeout=60)
        assert served.process.returncode != 0
        assert "2 restarts within 600 s already: stopping" in served.log()
    finally:
        stop_process_group(served.process)
