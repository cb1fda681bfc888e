"""Who may attach to a shared engine core, checked before a single byte of theirs is unpickled.

The core's listening socket (engine/share_files.py) lies in a directory only our uid can enter.
On top of that, on each connection the core

1. reads the peer's credentials from the kernel (SO_PEERCRED, taken at connect time, so they cannot
   be forged) and refuses a peer of another uid, or one that is not a process of the same server:
   the stub that started the core, or a child of the server process (Triton's stubs are);
2. reads a fixed-size raw hello (HELLO_MAGIC + the share's secret), with a size limit and a
   timeout so a silent peer holds nothing but its own thread, and compares the secret in
   constant time; only then does it answer ACK and start reading pickled frames (engine/ipc.py).

A refused peer is logged (pid, uid and why; never the bytes it sent) and closed.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from paged_llm.engine.ipc import FramedSocket

logger = logging.getLogger(__name__)

HELLO_MAGIC = b"PLLM-AT1"
ACK = b"PLLM-OK1"
AUTH_TIMEOUT_S = 5.0  # a peer that has not sent its whole hello by then is dropped
MAX_HANDSHAKES = 16  # connections being authenticated at once; more are refused
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return PeerCredentials(*_CREDENTIALS.unpack(raw))


def parent_pid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def peer_refusal(
    peer: PeerCredentials,
    uid: int,
    owner_pid: int,
    server_pid: int | None,
    parent_of: Callable[[int], int | None] = parent_pid_of,
) -> str | None:
    """Why a peer may not attach, or None if it may: it runs as `uid` and is the process that
    started the core (`owner_pid`) or a child of `server_pid` (the server whose stubs share it)."""
    if peer.uid != uid:
        return f"it runs as uid {peer.uid}, not {uid}"
    if peer.pid <= 0:
        return "its process is not visible here"
    if peer.pid == owner_pid:
        return None
    if server_pid is None:
        return f"it is not the process {owner_pid} that started the core"
    parent = parent_of(peer.pid)
    if parent != server_pid:
        return f"its parent is {parent}, not the server process {server_pid}"
    return None


def recv_exactly(sock: socket.socket, num_bytes: int, timeout_s: float) -> bytes | None:
    """Exactly `num_bytes` (never more: what follows stays for the framed link), or None on EOF or
    when they have not all come within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    received = bytearray()
    while len(received) < num_bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        readable, _, _ = select.select([sock], [], [], remaining)
        if not readable:
            return None
        try:
            chunk = sock.recv(num_bytes - len(received))
        except OSError:
            return None
        if not chunk:
            return None
        received += chunk
    return bytes(received)


def hello(secret: bytes) -> bytes:
    return HELLO_MAGIC + secret


class AttachGate:
    """Serves the core's listening socket from the moment the core process starts (so a refusal
    or an ACK never waits for the model to load); authenticated links wait until `serve_with`
    gives them a handler (the core is ready), which then runs on each link's own thread."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        owner_pid: int,
        server_pid: int | None,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:
        self._listener = listener
        self._expected_hello = hello(secret)
        self._owner_pid = owner_pid
        self._server_pid = server_pid
        self._auth_timeout_s = auth_timeout_s
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._lock = threading.Lock()
        self._handler: Callable[[FramedSocket], None] | None = None
        self._waiting: list[FramedSocket] = []
        self.num_refused = 0

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="paged_llm-core-accept", daemon=True).start()

    def serve_with(self, handler: Callable[[FramedSocket], None]) -> None:
        with self._lock:
            self._handler = handler
            waiting, self._waiting = self._waiting, []
        for link in waiting:
            self._hand_over(handler, link)

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError as error:
                logger.error("the engine core stopped accepting stubs: %s", error)
                return
            try:
                peer = peer_credentials(connection)
            except OSError as error:
                self._refuse(connection, None, f"its credentials cannot be read ({error})")
                continue
            reason = peer_refusal(peer, os.geteuid(), self._owner_pid, self._server_pid)
            if reason is not None:
                self._refuse(connection, peer, reason)
                continue
            if not self._handshakes.acquire(blocking=False):
                self._refuse(connection, peer, f"{MAX_HANDSHAKES} other connections are authenticating")
                continue
            threading.Thread(
                target=self._authenticate, args=(connection, peer), name="paged_llm-core-auth", daemon=True
            ).start()

    def _authenticate(self, connection: socket.socket, peer: PeerCredentials) -> None:
        try:
            received = recv_exactly(connection, len(self._expected_hello), self._auth_timeout_s)
            if received is None:
                self._refuse(connection, peer, "it sent no complete hello in time")
                return
            if not hmac.compare_digest(received, self._expected_hello):
                self._refuse(connection, peer, "it did not prove it has the share's secret")
                return
            try:
                connection.sendall(ACK)
            except OSError:
                connection.close()
                return
        finally:
            self._handshakes.release()
        link = FramedSocket(connection)
        with self._lock:
            handler = self._handler
            if handler is None:
                self._waiting.append(link)
                return
        handler(link)

    @staticmethod
    def _hand_over(handler: Callable[[FramedSocket], None], link: FramedSocket) -> None:
        threading.Thread(target=handler, args=(link,), name="paged_llm-core-in", daemon=True).start()

    def _refuse(self, connection: socket.socket, peer: PeerCredentials | None, reason: str) -> None:
        with self._lock:
            self.num_refused += 1
        who = "a peer" if peer is None else f"pid {peer.pid} (uid {peer.uid})"
        logger.warning("refused a connection to the engine core from %s: %s", who, reason)
        connection.close()
