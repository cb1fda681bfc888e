"""Length-prefixed pickle frames over a connected stream socket (the stub <-> engine core link).

A socketpair made by the stub; the core process inherits one end. Measured against pyzmq (PAIR
over ipc://) and multiprocessing's Pipe with step-sized messages (scripts/bench_ipc.py,
docs/benchmarks.md): all three cost far less than a decode step (tens of thousands of messages/s,
round trips of 0.1-0.3 ms on a 2-core VM) and none wins everywhere. The socketpair is kept because
the busy loop can send on it without ever blocking (MSG_DONTWAIT, engine/engine_core/process.py), it needs
no dependency, and the kernel closes it when either process dies, so each side sees EOF.

    frame:  [ payload length: 8 bytes, little endian ][ pickle protocol 5 payload ]

A stub that attaches to a shared core (engine/engine_core/stub_links.py) reaches it over a Unix socket
instead; there the first pickled frame is read only after the core's gate let the peer in
(engine/attach_gate.py): `pickle.loads` runs whatever the bytes say, so no unauthenticated byte
ever reaches `recv`.

`send` may be called from any thread (frames never interleave); `recv` / `poll` from one thread only.
`send_bytes_nowait` lets a busy loop send without ever blocking on a slow reader.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
import time
from typing import Any

_HEADER = struct.Struct("<Q")
_RECV_CHUNK_BYTES = 1 << 20
_NOTHING = object()


def encode_frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=5)
    return _HEADER.pack(len(payload)) + payload


class FramedSocket:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buffer = bytearray()

    def send(self, message: Any) -> None:
        """Raises OSError (BrokenPipeError, ...) when the other side is gone."""
        self.send_bytes(encode_frame(message))

    def send_bytes(self, frame: bytes | memoryview) -> None:
        """Sends (the rest of) a frame made by `encode_frame`, waiting for buffer space."""
        with self._send_lock:
            self.sock.sendall(frame)

    def send_bytes_nowait(self, frame: bytes | memoryview) -> int:
        """Sends what fits in the socket buffer now, without waiting; returns the bytes sent. The
        caller sends the rest (`send_bytes`) before any other frame."""
        with self._send_lock:
            try:
                return self.sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return 0

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next message; `_NOTHING`-free API: returns None on timeout, raises EOFError when the
        other side closed the connection. (Messages are never None.)"""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            message = self._take_frame()
            if message is not _NOTHING:
                return message
            try:  # data is often there already: one system call instead of select + recv
                chunk = self.sock.recv(_RECV_CHUNK_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._wait_readable(remaining):
                    return None
                chunk = self.sock.recv(_RECV_CHUNK_BYTES)
            if not chunk:
                raise EOFError("the other side closed the connection")
            self._buffer += chunk

    def poll(self) -> bool:
        """True if `recv` would return a message or EOF without waiting."""
        return self._has_frame() or self._wait_readable(0.0)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _wait_readable(self, timeout_s: float | None) -> bool:
        readable, _, _ = select.select([self.sock], [], [], timeout_s)
        return bool(readable)

    def _has_frame(self) -> bool:
        buffer = self._buffer
        return len(buffer) >= _HEADER.size and len(buffer) >= _HEADER.size + _HEADER.unpack_from(buffer)[0]

    def _take_frame(self) -> Any:
        if not self._has_frame():
            return _NOTHING
        (length,) = _HEADER.unpack_from(self._buffer)
        end = _HEADER.size + length
        message = pickle.loads(bytes(self._buffer[_HEADER.size : end]))
        del self._buffer[:end]
        return message
