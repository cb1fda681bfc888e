"""ModelUnloadWatch: an unload is a model that was ready and no longer is (triton_model/server_watch.py)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from paged_llm.triton_model.server_watch import Endpoint, ModelUnloadWatch


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


def test_shutdown_is_a_refused_or_reset_connection_after_an_answer():
    """Triton 2.51 drains HTTP connections on SIGTERM with its port still accepting, resetting
    each new connection: that counts as shutting down, like a refused port; a timeout does not."""
    import socket
    import struct

    from paged_llm.triton_model.server_watch import ServerShutdownWatch

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    mode = ["answer"]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if mode[0] == "answer":
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                conn.close()
            elif mode[0] == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # RST
            # "silent": keep it open and say nothing (a busy server)

    threading.Thread(target=serve, daemon=True).start()
    watch = ServerShutdownWatch(Endpoint("127.0.0.1", port))
    assert not watch.shutting_down()  # answered
    mode[0] = "silent"
    assert not watch.shutting_down()  # a timeout says nothing
    mode[0] = "reset"
    assert watch.shutting_down()
    assert watch.shutting_down()  # it stays
    listener.close()
    never_open = ServerShutdownWatch(Endpoint("127.0.0.1", port))
    assert not never_open.shutting_down()  # refused, but never seen answering: says nothing
