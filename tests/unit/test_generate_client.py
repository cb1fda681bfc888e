"""clients/generate.py --http against a local stand-in for Triton's generate_stream: the finish
reason is printed once, at the end, not as "None" after every token."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

_EVENTS = [
    {"model_name": "llm", "text_output": "Once", "finish_reason": "None"},
    {"model_name": "llm", "text_output": " upon", "finish_reason": "None"},
    {"model_name": "llm", "text_output": " a", "finish_reason": "length"},
]


@pytest.fixture(scope="module")
def generate() -> ModuleType:
    path = Path(__file__).parents[2] / "clients" / "generate.py"
    spec = importlib.util.spec_from_file_location("clients_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def generate_stream_url() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in _EVENTS:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        def log_message(self, *_args: object) -> None:  # (keeps the test's output clean)
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_prints_the_text_and_the_finish_reason_once(generate, generate_stream_url, capsys):
    assert generate.stream_http(generate_stream_url, "llm", "Tell me a story", {}, 10.0) == 0
    out, err = capsys.readouterr()
    assert out == "Once upon a"
    assert err.count("finish_reason") == 1 and err.strip() == "[finish_reason: length]"


def test_only_a_real_finish_reason_is_one(generate):
    assert generate.finish_reason("None") is None  # what Triton's events carry until the last
    assert generate.finish_reason(None) is None and generate.finish_reason("") is None
    assert generate.finish_reason("stop") == "stop"
    assert generate.finish_reason(["length", "None"]) == "length"
