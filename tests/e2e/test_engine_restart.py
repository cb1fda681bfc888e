"""A killed engine core is restarted in place (issue 41 row 1), seen from outside: a real
tritonserver with the llm model, the OpenAI server in front, the core killed with SIGKILL under
load. A restart is held at a gate (the core's interpreter, `engine_python`, is a script that waits
for the gate to open), so that the state while the engine is down is observed, not raced."""

from __future__ import annotations

import os
import queue
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from paged_llm.launcher.launch import ServerPorts
from paged_llm.launcher.repository import make_model_repository
from paged_llm.testing.server_process import RunningServer, free_ports, start_server, stop_process_group
from tests.e2e.client import make_inputs, stream_many
from tests.e2e.metrics import value, wait_for
from tests.e2e.test_openai import _get, _start_openai_server, post
from tests.e2e.test_robustness import StreamClient, our_processes

pytestmark = pytest.mark.timeout(600)
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
ENGINE_UP = "paged_llm_engine_up"


def _gated_python(directory: Path, gate: Path) -> Path:
    """An interpreter for the engine core that waits while `gate` exists, then runs this Python."""
    script = directory / "gated-python"
    script.write_text(
        f'#!/bin/sh\nwhile [ -e "{gate}" ]; do sleep 0.05; done\nexec "{sys.executable}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def gated_server(tmp_path) -> Iterator[tuple[RunningServer, Path]]:
    gate = tmp_path / "hold-the-restart"
    parameters = {"max_merged_steps": "1", "engine_python": str(_gated_python(tmp_path, gate))}
    repository = make_model_repository(tmp_path / "models", parameters, models=("llm",))
    running = start_server(repository, tmp_path / "server.log")
    try:
        yield running, gate
    finally:
        gate.unlink(missing_ok=True)
        running.stop()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _core_pids(server: RunningServer) -> list[int]:
    return [p.pid for p in our_processes(server)["cores"] if p.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_core_under_load_fails_each_stream_once_says_503_and_serves_again(gated_server, tmp_path):
    server, gate = gated_server
    openai_server, base_url = _start_openai_server(server.grpc_url, tmp_path / "openai_server.log")
    clients: list[StreamClient] = []
    try:
        assert wait_for(lambda: value(server.metrics(), ENGINE_UP) == 1)
        # /health probed the model (the OpenAI server is healthy): no request reached the engine
        assert value(server.metrics(), "paged_llm_final_responses_total") == 0
        assert value(server.metrics(), "paged_llm_generation_tokens_total") == 0
        clients = [StreamClient(server.grpc_url) for _ in range(4)]
        for index, client in enumerate(clients):
            client.send(f"k{index}", f"doomed {index}", stream=True, sampling_parameters=LONG)
        for client in clients:
            assert client.next()[1] is None  # each is running
        assert wait_for(lambda: value(server.metrics(), "paged_llm_num_requests_running") == 4)
        assert value(server.metrics(), "paged_llm_kv_cache_usage_ratio") > 0
        [core_pid] = _core_pids(server)
        gate.touch()  # the restart waits until the gate opens
        killed_at = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        for client in clients:
            while True:  # data responses may still be on their way; then exactly one error
                _result, error = client.next(timeout_s=30)
                if error is not None:
                    message = str(error)
                    assert "engine core process" in message and "SIGKILL" in message, message
                    assert str(core_pid) not in message, message  # the pid is for the log only
                    break
        assert wait_for(
            lambda: _get(f"{base_url}/health")[0] == 503, timeout_s=5.0 - (time.monotonic() - killed_at)
        )
        assert wait_for(
            lambda: value(server.metrics(), "paged_llm_final_responses_total", code="internal") == 4
        )
        for client in clients:  # nothing more came after the one error of each stream
            with pytest.raises(queue.Empty):
                client.next(timeout_s=0.5)
            client.cancel()
        clients = []

        def down() -> bool:  # the gauges read 0 while the engine is down, not their last values
            text = server.metrics()
            return all(
                value(text, name) == 0
                for name in (ENGINE_UP, "paged_llm_num_requests_running", "paged_llm_kv_cache_usage_ratio")
            )

        assert wait_for(down)
        [refused] = stream_many(
            server.grpc_url, [make_inputs("meanwhile", sampling_parameters={"max_tokens": 2})]
        )
        assert refused.finals == 1 and "retry in a few seconds" in refused.errors[0], refused.errors
        status, answer, headers = post(
            base_url, "/v1/completions", {"model": "llm", "prompt": "meanwhile", "max_tokens": 2}, None
        )
        assert status == 503 and "retry-after" in headers, answer
        assert _get(f"{base_url}/health")[0] == 503
        gate.unlink()
        opened_at = time.monotonic()
        assert wait_for(lambda: _get(f"{base_url}/health")[0] == 200, timeout_s=30, interval_s=0.25), (
            server.log()[-3000:]
        )
        assert time.monotonic() - opened_at < 30
        status, answer, _ = post(
            base_url, "/v1/completions", {"model": "llm", "prompt": "again", "max_tokens": 3}, None
        )
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
        assert wait_for(lambda: value(server.metrics(), ENGINE_UP) == 1)
        assert _core_pids(server) != [core_pid]
        assert "the engine core was restarted and serves again" in server.log()
        assert f"the engine core process (pid {core_pid}) was killed by SIGKILL" in server.log()
    finally:
        for client in clients:
            client.cancel()
        stop_process_group(openai_server, signal.SIGTERM)


def test_a_core_killed_each_time_it_comes_back_makes_the_launcher_exit_non_zero(tmp_path):
    """engine_max_restarts 1: the first death is restarted, the second makes the stub give up
    and exit; the launcher sees the dead stub, stops the server and exits non-zero. Every core
    that comes up is killed until then (a launcher that restarts what died, bounded, ends so too)."""
    repository = make_model_repository(tmp_path / "models", {"engine_max_restarts": "1"}, models=("llm",))
    http, grpc, metrics = free_ports(3)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "paged_llm.launcher.launch", "serve",
             "--model-repository", str(repository),
             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
             "--exit-timeout-secs", "3"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    server = RunningServer(launcher, ServerPorts(http, grpc, metrics), log_path)
    killed: list[int] = []
    seen: set[int] = set()

    def cores() -> list[int]:
        found = []
        for child in psutil.Process(launcher.pid).children(recursive=True):
            seen.add(child.pid)
            try:
                if "paged_llm.engine.engine_core.process" in " ".join(child.cmdline()):
                    found.append(child.pid)
            except psutil.Error:  # gone, or a zombie
                pass
        return found

    def serving() -> bool:
        """The core that is up now finished its handshake: the server's first one once the model
        is ready, each later one once the stub said it serves again."""
        restarts = log_path.read_text(errors="replace").count(
            "the engine core was restarted and serves again"
        )
        return restarts >= len(killed) and server.is_ready()

    try:
        deadline = time.monotonic() + 400
        while launcher.poll() is None and time.monotonic() < deadline:
            for pid in cores() if serving() else []:
                if pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.2)
        status = launcher.wait(timeout=30)
        log_text = log_path.read_text(errors="replace")
        assert status != 0, log_text[-3000:]
        assert len(killed) == 2, (killed, log_text[-3000:])
        assert "(engine_max_restarts 1): not restarted" in log_text, log_text[-3000:]
        assert wait_for(lambda: not [pid for pid in seen if psutil.pid_exists(pid) and _alive(pid)], 10.0)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_two_instances_sharing_a_killed_core_serve_again_on_one_new_core(tmp_path):
    """instance_group count 2: both stubs lose the core; one starts the new core, the other attaches
    to it, and the engine-up gauge (reported by the core's owner only) reads 1, not 2."""
    repository = make_model_repository(tmp_path / "models", models=("llm",), instance_count=2)
    server = start_server(repository, tmp_path / "server.log")
    try:
        assert wait_for(lambda: value(server.metrics(), ENGINE_UP) == 1)
        [core_pid] = _core_pids(server)
        os.kill(core_pid, signal.SIGKILL)

        def served_again() -> bool:
            cores = _core_pids(server)
            return len(cores) == 1 and cores != [core_pid] and server.log().count("serves again") == 2

        assert wait_for(served_again, timeout_s=60, interval_s=0.25), server.log()[-3000:]
        requests = [make_inputs(f"again {i}", sampling_parameters={"max_tokens": 3}) for i in range(8)]
        results = stream_many(server.grpc_url, requests)  # spread over both instances
        assert all(r.finals == 1 and not r.errors for r in results), [r.errors for r in results]
        assert wait_for(lambda: value(server.metrics(), ENGINE_UP) == 1)
        assert value(server.metrics(), ENGINE_UP) == 1
    finally:
        server.stop()
