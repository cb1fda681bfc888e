"""A tritonserver child process on fresh ports, for tests, benchmarks and the soak script, and copies
of the package's model repository with overridden engine settings.

Started with `start_server` (waits until /v2/health/ready), stopped by pid (`stop`): SIGTERM to its
process group, SIGKILL if it has not exited in time. A short exit timeout (3 s) keeps restarts fast.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from paged_llm.paths import model_repository_template
from paged_llm.processes import parent_death_signal
from paged_llm.tools.launch import ServerPorts, endpoint_disabled, server_command, server_env
from paged_llm.tools.procfs import process_group_members
from paged_llm.tools.shm_regions import (  # noqa: F401 (re-exported: tests and scripts use them here)
    SHM_DIR,
    SHM_REGION_GLOB,
    remove_orphaned_shm_regions,
    remove_unused_regions,
    stub_regions,
)

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
        regions = stub_regions(group)  # removed below once unused (tools/shm_regions.py)
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


# The TensorRT-LLM client convention: llm_trtllm (the tensorrt_llm model's outputs), and the names
# TensorRT-LLM's own clients use (ensemble / tensorrt_llm_bls, the ensemble's outputs); all forward to llm.
TRTLLM_MODEL_NAMES = ("llm_trtllm", "ensemble", "tensorrt_llm_bls")


def make_model_repository(
    target: Path,
    parameters: dict[str, str] | None = None,
    models: tuple[str, ...] = ("llm", "llm_trtllm"),
    source: Path | None = None,
    instance_count: int | None = None,
    instance_gpus: list[int] | None = None,
) -> Path:
    """Copies the models of `source` (default: the package's template) into `target`, overriding
    `parameters` of the llm model (and its instance_group count: that many Triton instances, sharing
    one engine core). `instance_gpus`: a KIND_GPU group instead, `instance_count` instances on each
    listed GPU, one engine per GPU."""
    source = source or model_repository_template()
    for name in models:
        shutil.rmtree(target / name, ignore_errors=True)  # a fresh copy each time
        shutil.copytree(source / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    config_path = target / "llm" / "config.pbtxt"
    if instance_gpus:
        gpus = ", ".join(str(gpu) for gpu in instance_gpus)
        group = f"instance_group [ {{ count: {instance_count or 1}, kind: KIND_GPU, gpus: [ {gpus} ] }} ]"
        config, found = re.subn(r"^instance_group \[.*\]$", group, config_path.read_text(), flags=re.M)
        if found != 1:
            raise ValueError(f"no instance_group in {config_path}")
        config_path.write_text(config)
    elif instance_count is not None:
        config, found = re.subn(
            r"instance_group \[ \{ count: \d+",
            f"instance_group [ {{ count: {instance_count}",
            config_path.read_text(),
        )
        if found != 1:
            raise ValueError(f"no instance_group count in {config_path}")
        config_path.write_text(config)
    if parameters:
        config = config_path.read_text()
        lines = [line for line in config.splitlines() if not any(f'key: "{k}"' in line for k in parameters)]
        for key, value in parameters.items():
            lines.append(f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}')
        config_path.write_text("\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m paged_llm.tools.server_process make-repository TARGET key=value ...`"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m paged_llm.tools.server_process")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-repository", help="copy the llm model with overridden parameters")
    make.add_argument("target", type=Path)
    make.add_argument("parameters", nargs="*", help="key=value engine settings for config.pbtxt")
    make.add_argument("--instance-count", type=int, help="Triton instances of llm (they share one core)")
    make.add_argument(
        "--instance-gpus", help="comma-separated GPU ids: a KIND_GPU instance group (one engine per GPU)"
    )
    args, rest = parser.parse_known_args(argv)  # key=value pairs may also follow the options
    if any("=" not in item for item in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parameters = dict(item.split("=", 1) for item in args.parameters + rest)
    gpus = [int(gpu) for gpu in args.instance_gpus.split(",")] if args.instance_gpus else None
    target = make_model_repository(
        args.target, parameters, models=("llm",), instance_count=args.instance_count, instance_gpus=gpus
    )
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
