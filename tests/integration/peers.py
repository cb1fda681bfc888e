"""Peers of an engine core's socket for the tests: processes run as another uid (fork + setuid: the
tests run as root), and a frame that creates a file if anyone unpickles it."""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path

from paged_llm.engine.ipc import encode_frame

NOBODY_UID = 65534


class CreatesFile:
    """Unpickling this opens (creates) `path`: the attack of issue 41 row 4, harmless."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_frame(marker: Path) -> bytes:
    return encode_frame(CreatesFile(marker))


def send_and_wait_for_close(path: Path, data: bytes, timeout_s: float = 30.0) -> str:
    """Connects to `path`, sends `data`, and tells what happened: "closed" when the other side closed
    the connection, "open" if it still had not after `timeout_s`, or the error that stopped us."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(str(path))
        except OSError as error:
            return type(error).__name__
        try:
            sock.sendall(data)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                readable, _, _ = select.select([sock], [], [], deadline - time.monotonic())
                if readable:
                    chunk = sock.recv(4096)
                    return f"answered {chunk[:16]!r}" if chunk else "closed"
            return "open"
        except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread
            return "closed"
    finally:
        sock.close()


def run_in_child(action: Callable[[], str], uid: int | None = None, timeout_s: float = 60.0) -> str:
    """`action()` in a forked child (as `uid`, if given), its result as a string."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions past here
        code = 0
        try:
            os.close(read_fd)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            result = action()
        except BaseException as error:
            result, code = f"{type(error).__name__}: {error}", 1
        os.write(write_fd, result.encode()[:4096])
        os._exit(code)
    os.close(write_fd)
    try:
        readable, _, _ = select.select([read_fd], [], [], timeout_s)
        result = os.read(read_fd, 4096).decode() if readable else "child timed out"
    finally:
        os.close(read_fd)
        if result == "child timed out":
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    return result


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
