"""The engine core's gate (engine/attach_gate.py) on a real socket that every uid can reach, so that
the gate is the only check: real peers of another uid, peers without the secret, a silent peer.
Every refused peer's first frame would create a file if it were unpickled."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from paged_llm.engine.attach_gate import ACK, AttachGate, hello
from paged_llm.engine.ipc import FramedSocket, encode_frame
from paged_llm.engine.share_files import SECRET_BYTES
from tests.integration.peers import (
    NOBODY_UID,
    evil_frame,
    run_in_child,
    send_and_wait_for_close,
    wait_until,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a peer as another uid needs root")


@dataclass
class OpenGate:
    gate: AttachGate
    path: Path
    secret: bytes
    marker: Path
    received: list[object] = field(default_factory=list)

    def serve(self, link: FramedSocket) -> None:  # the core's handler of stubs, reduced
        while True:
            try:
                self.received.append(link.recv())
            except (EOFError, OSError):
                return

    def attach_and_send(self, message: object) -> str:
        """A legitimate stub: hello with the secret, then one pickled frame."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.path))
            sock.sendall(hello(self.secret))
            sock.settimeout(30)
            answer = sock.recv(len(ACK))
            sock.sendall(encode_frame(message))
            assert wait_until(lambda: message in self.received)
            return answer.decode()
        finally:
            sock.close()


@pytest.fixture
def open_gate() -> Iterator[OpenGate]:
    directory = Path(tempfile.mkdtemp(prefix="pl-gate-"))
    directory.chmod(0o755)
    path = directory / "core.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o777)  # any uid may connect: only the gate decides
    listener.listen(16)
    secret = secrets.token_bytes(SECRET_BYTES)
    # This process plays the server: the children the tests fork are its "stubs".
    gate = AttachGate(listener, secret, owner_pid=os.getpid(), server_pid=os.getpid(), auth_timeout_s=2.0)
    opened = OpenGate(gate, path, secret, directory / "unpickled")
    gate.start()
    gate.serve_with(opened.serve)
    try:
        yield opened
    finally:
        listener.close()
        shutil.rmtree(directory)


@needs_root
def test_a_foreign_uid_peer_is_refused_before_its_frame_is_read(open_gate):
    result = run_in_child(
        lambda: send_and_wait_for_close(open_gate.path, evil_frame(open_gate.marker)), uid=NOBODY_UID
    )
    assert result == "closed"
    assert open_gate.gate.num_refused == 1
    assert not open_gate.marker.exists() and open_gate.received == []
    # Even with the secret (which it could not read from a real share's directory).
    with_secret = hello(open_gate.secret) + evil_frame(open_gate.marker)
    result = run_in_child(lambda: send_and_wait_for_close(open_gate.path, with_secret), uid=NOBODY_UID)
    assert result == "closed" and open_gate.gate.num_refused == 2
    assert not open_gate.marker.exists() and open_gate.received == []
    assert open_gate.attach_and_send("still served") == ACK.decode()


def test_a_same_uid_stub_without_the_secret_is_refused_before_its_frame_is_read(open_gate):
    result = run_in_child(lambda: send_and_wait_for_close(open_gate.path, evil_frame(open_gate.marker)))
    assert result == "closed"
    wrong = hello(bytes(SECRET_BYTES)) + evil_frame(open_gate.marker)
    assert run_in_child(lambda: send_and_wait_for_close(open_gate.path, wrong)) == "closed"
    assert open_gate.gate.num_refused == 2
    assert not open_gate.marker.exists() and open_gate.received == []
    # A stub of the same server with the secret is let in.
    right = hello(open_gate.secret) + encode_frame("from a stub")
    assert run_in_child(lambda: send_and_wait_for_close(open_gate.path, right, timeout_s=0.5)).startswith(
        "answered b'PLLM-OK1'"
    )
    assert wait_until(lambda: "from a stub" in open_gate.received)


def test_a_silent_peer_is_dropped_and_stalls_nobody(open_gate):
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(open_gate.path))
    silent.sendall(hello(open_gate.secret)[:5])  # part of a hello, then nothing
    try:
        assert open_gate.attach_and_send("while another waits") == ACK.decode()
        silent.settimeout(30)
        assert silent.recv(16) == b""  # closed by the gate after its auth timeout
        assert open_gate.gate.num_refused == 1
    finally:
        silent.close()


def test_links_that_authenticate_before_the_core_is_ready_wait_for_it():
    left, right = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory = Path(tempfile.mkdtemp(prefix="pl-gate-"))
    try:
        listener.bind(str(directory / "core.sock"))
        listener.listen(4)
        secret = secrets.token_bytes(SECRET_BYTES)
        gate = AttachGate(listener, secret, owner_pid=os.getpid(), server_pid=None)
        gate.start()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(directory / "core.sock"))
        client.sendall(hello(secret))
        client.settimeout(30)
        assert client.recv(len(ACK)) == ACK  # let in while the core still loads
        handled = threading.Event()
        gate.serve_with(lambda link: handled.set())
        assert handled.wait(30)
        client.close()
    finally:
        left.close()
        right.close()
        listener.close()
        shutil.rmtree(directory)
