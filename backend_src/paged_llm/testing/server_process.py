"""A tritonserver child process on fresh ports, for tests, benchmarks and the soak script.
Copies of the model repository with overridden engine settings: paged_llm/launcher/repository.py.

Started with `start_server` (waits until /v2/health/ready), stopped by pid (`stop`): SIGTERM to its
process group, SIGKILL if it has not exited in time. A short exit timeout (3 s) keeps restarts fast.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from paged_llm.launcher.launch import ServerPorts, endpoint_disabled, server_command, server_env
from paged_llm.launcher.procfs import process_group_members
from paged_llm.launcher.shm_regions import remove_unused_regions, stub_regions
from paged_llm.processes import parent_death_signal

logger = logging.getLogger(__name__)


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class RunningServer:
    process: subprocess.Popen
    ports: ServerPorts
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics_listening(self) -> bool:
        """Whether the metrics port accepts connections: Triton opens it last, after HTTP says
        ready (seen on a busy 2-core machine: a metrics read right after readiness was refused)."""
        try:
            with socket.create_connection(("127.0.0.1", self.ports.metrics), timeout=2):
                return True
        except OSError:
            return False

    def stop(self, timeout_s: float = 30.0, stragglers_timeout_s: float = 15.0) -> None:
        """SIGTERM to the server's process group; SIGKILL to it after `timeout_s`. Then waits up to
        `stragglers_timeout_s` for the rest of the group (stubs, engine cores), which may outlive the
        server by seconds, before killing it too: a caller that next cleans up shared memory must
        not find a stub still mapping it."""
        group = self.process.pid  # started with start_new_session: its own process group
        regions = stub_regions(group)  # removed below once unused (launcher/shm_regions.py)
        try:
            self._stop_group(group, timeout_s, stragglers_timeout_s)
        finally:
            remove_unused_regions(regions, timeout_s=5.0)

    def _stop_group(self, group: int, timeout_s: float, stragglers_timeout_s: float) -> None:
        if self.process.poll() is None or process_group_members(group):
            _signal_group(group, signal.SIGTERM)
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(group, signal.SIGKILL)
                self.process.wait(timeout=10)
        if _wait_for_group_exit(group, stragglers_timeout_s):
            return
        _signal_group(group, signal.SIGKILL)
        if not _wait_for_group_exit(group, 5.0):
            logger.warning(
                "processes of tritonserver's group %d survived SIGKILL: %s",
                group,
                process_group_members(group),
            )


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:  # nobody left in it
        pass


def _wait_for_group_exit(group: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_group_members(group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def start_server(
    model_repository: Path,
    log_path: Path,
    extra_args: list[str] | None = None,
    timeout_s: float = 180.0,
    ports: ServerPorts | None = None,
) -> RunningServer:
    """Starts tritonserver on `ports` (default: free ones) and waits until it is ready. Call it from
    a thread that outlives the server (the main thread): the server gets SIGTERM when that thread
    exits."""
    ports = ports or ServerPorts(*free_ports(3))
    command = server_command(model_repository, ports, exit_timeout_secs=3, extra_args=extra_args)
    # The server process writes it for as long as it runs; its user's alone, like the server's files.
    log_file = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
    os.fchmod(log_file.fileno(), 0o600)  # a log left by an earlier run keeps its mode otherwise
    process = subprocess.Popen(
        command,
        env=server_env(),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=parent_death_signal(signal.SIGTERM),  # a test run or benchmark killed hard
    )
    server = RunningServer(process, ports, log_path)
    metrics_disabled = endpoint_disabled(extra_args or [], "metrics")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{server.log()[-5000:]}")
        if server.is_ready() and (metrics_disabled or server.metrics_listening()):
            return server
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(f"tritonserver not ready after {timeout_s} s:\n{server.log()[-5000:]}")


def http_status(url: str, timeout_s: float = 10.0) -> int:
    """The HTTP status of a GET of `url` (0: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def wait_until_healthy(
    health_url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 300.0
) -> None:
    """Polls `health_url` until it answers 200 (a process started with its own session, e.g.
    `paged-llm serve`); raises with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_path.read_text(errors="replace")
            raise AssertionError(f"exited with {process.returncode}:\n{log[-4000:]}")
        if http_status(health_url, 5.0) == 200:
            return
        time.sleep(0.25)
    raise AssertionError(f"not healthy after {timeout_s} s:\n{log_path.read_text(errors='replace')[-4000:]}")


def stop_process_group(
    process: subprocess.Popen, signum: int = signal.SIGINT, timeout_s: float = 30.0
) -> None:
    """Stops a process started with its own session, and its group: `signum`, then SIGKILL."""
    if process.poll() is None:
        _signal_group(process.pid, signum)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
