"""Starts a real tritonserver for tests: fresh free ports, a short exit timeout, stopped by pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from paged_llm.launch import ServerPorts, server_command, server_env
from paged_llm.paths import repo_root

REPO_MODELS = repo_root() / "model_repository"


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

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def make_model_repository(
    target: Path, parameters: dict[str, str] | None = None, models: tuple[str, ...] = ("llm", "llm_trtllm")
) -> Path:
    """Copies the repository's models into `target`, overriding `parameters` of the llm model."""
    for name in models:
        shutil.copytree(REPO_MODELS / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    if parameters:
        config_path = target / "llm" / "config.pbtxt"
        config = config_path.read_text()
        lines = [line for line in config.splitlines() if not any(f'key: "{k}"' in line for k in parameters)]
        lines += [
            f'parameters: {{ key: "{k}", value: {{ string_value: "{v}" }} }}' for k, v in parameters.items()
        ]
        config_path.write_text("\n".join(lines) + "\n")
    return target


def start_server(
    model_repository: Path, log_path: Path, extra_args: list[str] | None = None, timeout_s: float = 180.0
) -> RunningServer:
    http, grpc, metrics = free_ports(3)
    ports = ServerPorts(http, grpc, metrics)
    command = server_command(model_repository, ports, exit_timeout_secs=3, extra_args=extra_args)
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        command, env=server_env(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    server = RunningServer(process, ports, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{server.log()[-5000:]}")
        if server.is_ready():
            return server
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(f"tritonserver not ready after {timeout_s} s:\n{server.log()[-5000:]}")
