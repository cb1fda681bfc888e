"""Puts the HTTP guard (launcher/http_guard.py) in front of tritonserver's HTTP and metrics ports.

Clients reach the public ports on the launcher's --address; tritonserver binds its HTTP and metrics
endpoints to ports of its own on 127.0.0.1 (gRPC stays public: a body of any size or type there
does not crash it). The guard runs as a child process of the launcher and outlives tritonserver
restarts: while Triton is down it answers 503.

What remains: a process on the same host (inside a container: the same pod) can reach the
loopback ports directly; tritonserver 2.51 parses the body before --http-restricted-api is checked,
so no header can close them.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from paged_llm.processes import parent_death_signal

# The guard's body cap (launcher/http_guard.py). Here, not there: starting the guard must not need
# httptools in the launcher's own environment (the guard process imports it).
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

TRITON_LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class GuardedPorts:
    public: Any  # launch.ServerPorts: what clients reach on the launcher's address
    triton: Any  # what tritonserver binds: HTTP and metrics on TRITON_LOOPBACK, gRPC public
    guarded: tuple[str, ...]  # the endpoints behind the guard: "http", "metrics"

    @property
    def triton_http_url(self) -> str:
        return f"http://{TRITON_LOOPBACK}:{self.triton.http}"


def loopback_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((TRITON_LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def guarded_ports(public: Any, guarded: tuple[str, ...] = ("http", "metrics")) -> GuardedPorts:
    """`public` (a launch.ServerPorts) with fresh loopback ports for tritonserver's `guarded`
    endpoints (those that are on)."""
    http, metrics = loopback_ports(2)
    triton = replace(
        public,
        http=http if "http" in guarded else public.http,
        metrics=metrics if "metrics" in guarded else public.metrics,
    )
    return GuardedPorts(public, triton, guarded)


def guard_command(
    address: str, ports: GuardedPorts, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> list[str]:
    host = f"[{address}]" if ":" in address else address
    command = [sys.executable, "-m", "paged_llm.launcher.http_guard", "--max-body-bytes", str(max_body_bytes)]
    for name in ports.guarded:
        command += ["--listen", f"{host}:{getattr(ports.public, name)}={getattr(ports.triton, name)}"]
    return command


def start_guard(
    address: str, ports: GuardedPorts, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout_s: float = 30.0
) -> subprocess.Popen | None:
    """Starts the guard and waits until it listens (None when nothing is guarded); RuntimeError if
    it cannot bind its ports."""
    if not ports.guarded:
        return None
    process = subprocess.Popen(
        guard_command(address, ports, max_body_bytes),
        stdout=subprocess.PIPE,
        preexec_fn=parent_death_signal(signal.SIGTERM),  # the launcher killed hard
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stdout], [], [], 0.2)
        if readable:
            line = process.stdout.readline()
            if line.strip() == b"listening":
                return process
        if process.poll() is not None:
            raise RuntimeError(f"the HTTP guard exited ({process.returncode}) before listening")
    stop_guard(process)
    raise RuntimeError(f"the HTTP guard did not listen within {timeout_s:.0f} s")


def stop_guard(process: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
