"""ModelUnloadWatch: an unload is a model that was ready and no longer is (serving/server_watch.py)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from paged_llm.serving.server_watch import Endpoint, ModelUnloadWatch


class _Ready(http.server.BaseHTTPRequestHandler):
    statuses: ClassVar[list[int]] = []
    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Ready.paths.append(self.path)
        self.send_response(_Ready.statuses.pop(0))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Endpoint]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Endpoint("127.0.0.1", httpd.server_address[1])
    httpd.shutdown()


def test_not_ready_counts_only_after_ready(server):
    _Ready.statuses[:] = [400, 200, 200, 400, 200]
    _Ready.paths.clear()
    watch = ModelUnloadWatch(server, "llm", "1")
    assert [watch.unloading() for _ in range(4)] == [False, False, False, True]
    assert watch.unloading()  # it stays: no more questions asked
    assert _Ready.paths == ["/v2/models/llm/versions/1/ready"] * 4


def test_no_http_endpoint_or_no_answer_is_never_an_unload(server):
    assert not ModelUnloadWatch(Endpoint("127.0.0.1", server.port, protocol="grpc"), "llm", "1").unloading()
    assert not ModelUnloadWatch(None, "llm", "1").unloading()
    _Ready.statuses[:] = [200, 403]  # a restricted health API says nothing about the model
    watch = ModelUnloadWatch(server, "llm", "1")
    assert not watch.unloading() and not watch.unloading()


def test_a_request_seen_counts_as_ready(server):
    """The unload may begin before the first look: a request that arrived proves the model was READY."""
    _Ready.statuses[:] = [400]
    watch = ModelUnloadWatch(server, "llm", "1")
    watch.mark_ready()
    assert watch.unloading()
