"""launch serve checks its ports before tritonserver loads anything (issue 11 row 6)."""

from __future__ import annotations

import socket
import subprocess
import sys

from paged_llm.launcher.launch import ServerPorts, busy_ports, endpoint_disabled
from paged_llm.testing.server_process import free_ports


def listener(port: int, reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse_port:  # as gRPC servers bind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_busy_ports_names_each_listener_and_skips_disabled_endpoints():
    http, grpc, metrics = free_ports(3)
    ports = ServerPorts(http, grpc, metrics)
    assert busy_ports("127.0.0.1", ports) == []
    with listener(grpc, reuse_port=True), listener(metrics):
        busy = busy_ports("127.0.0.1", ports)
        assert [entry.split(" (")[0] for entry in busy] == [
            f"gRPC port {grpc} on 127.0.0.1",
            f"metrics port {metrics} on 127.0.0.1",
        ]
        assert len(busy_ports("127.0.0.1", ports, ["--allow-metrics=false"])) == 1


def test_serve_on_a_busy_port_exits_before_starting_anything():
    http, grpc, metrics = free_ports(3)
    with listener(http):
        done = subprocess.run(
            [sys.executable, "-m", "paged_llm.launcher.launch", "serve",
             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"cannot serve: HTTP port {http} on 127.0.0.1" in done.stderr
    assert "Starting tritonserver" not in done.stderr


def test_endpoint_disabled_reads_both_flag_forms_and_the_last_value():
    assert endpoint_disabled(["--allow-metrics=false"], "metrics")
    assert endpoint_disabled(["--allow-metrics", "0"], "metrics")
    assert endpoint_disabled(["--allow-grpc=OFF"], "grpc")
    assert not endpoint_disabled(["--allow-metrics=false"], "grpc")
    assert not endpoint_disabled(["--allow-metrics=false", "--allow-metrics=true"], "metrics")
    assert not endpoint_disabled([], "http")
