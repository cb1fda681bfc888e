"""The engine core in its own process, seen from outside: response granularity, the core dying under
load, and tritonserver stopped by SIGINT / SIGTERM / SIGKILL leaving no process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from paged_llm.launcher.launch import ServerPorts, server_command, server_env
from paged_llm.launcher.shm_regions import SHM_DIR, remove_orphaned_shm_regions
from paged_llm.launcher.supervise import DEAD_STUB_EXIT_STATUS, STUB_CHECK_INTERVAL_S
from tests.e2e.client import http_post, stream
from tests.e2e.metrics import value, wait_for
from tests.e2e.server import (
    RunningServer,
    free_ports,
    live_children_named,
    make_model_repository,
    start_server,
)
from tests.e2e.test_robustness import StreamClient, our_processes

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
EXIT_BOUND_S = 10.0  # the bound: nothing of ours left this long after the signal


@pytest.fixture
def fresh_server(tmp_path) -> Iterator[RunningServer]:
    """A server of its own (these tests kill parts of it); responses never merge steps."""
    repository = make_model_repository(tmp_path / "models", {"max_merged_steps": "1"}, models=("llm",))
    running = start_server(repository, tmp_path / "server.log")
    yield running
    running.stop()


def test_single_greedy_stream_of_32_tokens_arrives_as_32_responses(fresh_server):
    params = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
    streamed = stream(
        fresh_server.grpc_url, "one token per response", stream=True, sampling_parameters=params
    )
    assert not streamed.errors and streamed.finals == 1
    assert [len(r.as_numpy("output_ids")) for r in streamed.responses] == [1] * 32
    whole = stream(
        fresh_server.grpc_url,
        "one token per response",
        sampling_parameters=params,
        exclude_input_in_output=True,
    )
    assert streamed.text == whole.text


def test_default_server_counts_streamed_responses_and_their_tokens(server):
    """Merging is allowed by default (only when the sender lags); every token is accounted for."""
    before = server.metrics()
    params = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
    streamed = stream(server.grpc_url, "count my responses", stream=True, sampling_parameters=params)
    sizes = [len(r.as_numpy("output_ids")) for r in streamed.responses]
    assert sum(sizes) == 32 and 1 <= len(sizes) <= 32

    def delta(name: str) -> float:
        return value(server.metrics(), name) - value(before, name)

    assert wait_for(lambda: delta("paged_llm_streamed_responses_total") == len(sizes), timeout_s=10)
    assert delta("paged_llm_streamed_response_tokens_total") == 32


def test_killing_the_engine_core_fails_in_flight_requests_once_each(fresh_server):
    [core] = our_processes(fresh_server)["cores"]
    clients = [StreamClient(fresh_server.grpc_url) for _ in range(6)]
    for index, client in enumerate(clients):
        client.send(f"k{index}", f"doomed {index}", stream=True, sampling_parameters=LONG)
    for client in clients:
        _result, error = client.next()  # each is running
        assert error is None
    core.kill()
    for client in clients:
        while True:  # data responses may still be on their way; then exactly one error
            _result, error = client.next(timeout_s=30)
            if error is not None:
                assert "engine core process" in str(error) and "SIGKILL" in str(error), str(error)
                break
        client.cancel()
    assert wait_for(
        lambda: value(fresh_server.metrics(), "paged_llm_final_responses_total", code="internal") == 6
    )
    # (What follows, the restart, is tests/e2e/test_engine_restart.py's.)
    assert "engine core process" in fresh_server.log() and "was killed by SIGKILL" in fresh_server.log()


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _load(server: RunningServer, count: int = 4) -> list[StreamClient]:
    """Long streams, each running; the clients keep their gRPC streams open."""
    clients = [StreamClient(server.grpc_url) for _ in range(count)]
    for index, client in enumerate(clients):
        client.send(f"s{index}", f"busy {index}", stream=True, sampling_parameters=LONG)
    for client in clients:
        client.next()
    return clients


def _assert_gone_within_bound(pids: list[int], what: str) -> None:
    sent_at = time.monotonic()
    gone = wait_for(lambda: not _alive(pids), timeout_s=EXIT_BOUND_S, interval_s=0.2)
    left = {pid: " ".join(psutil.Process(pid).cmdline()[:3])[-120:] for pid in _alive(pids)}
    assert gone, f"still alive {time.monotonic() - sent_at:.1f} s after {what}: {left}"


@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGKILL, False)],
    ids=["sigint-to-the-group", "sigterm", "sigkill"],
)
def test_stopping_tritonserver_under_load_leaves_no_process_of_ours(fresh_server, signum, to_group):
    """Stub and engine core are gone within the bound; tritonserver itself may hang at exit while
    clients keep gRPC streams open (Triton 2.51, see triton_model/server_watch.py): `make serve`'s
    supervisor deals with that (next test), here the fixture kills it."""
    ours = our_processes(fresh_server)
    assert len(ours["stubs"]) == 1 and len(ours["cores"]) == 1
    pids = [p.pid for p in ours["stubs"] + ours["cores"]]
    clients = _load(fresh_server)
    if to_group:
        os.killpg(fresh_server.process.pid, signum)
    else:
        os.kill(fresh_server.process.pid, signum)
    _assert_gone_within_bound(pids, signum.name)
    for client in clients:  # cancel: a plain close waits for finals a hung tritonserver never sends
        client.cancel()


def _start_launcher(tmp_path, server_args: list[str] | None = None) -> tuple[subprocess.Popen, RunningServer]:
    """`make serve-triton`'s launcher on the llm model, free ports, a 3 s exit timeout; its output
    goes to tmp_path/serve.log (the RunningServer's log)."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    http, grpc, metrics = free_ports(3)
    log = open(tmp_path / "serve.log", "w")  # the launcher writes it while it runs
    launcher = subprocess.Popen(
        [sys.executable, "-m", "paged_llm.launcher.launch", "serve", "--model-repository", str(repository),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--exit-timeout-secs", "3", *(["--", *server_args] if server_args else [])],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return launcher, RunningServer(launcher, ServerPorts(http, grpc, metrics), tmp_path / "serve.log")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_make_serve_stops_everything_under_load(tmp_path, signum):
    """`make serve`'s launcher: Ctrl-C (SIGINT to the group) or SIGTERM to it, with clients still
    streaming: launcher, HTTP guard, tritonserver, stub and core all gone within the bound."""
    launcher, server = _start_launcher(tmp_path)
    try:
        assert wait_for(server.is_ready, timeout_s=180, interval_s=0.25), server.log()[-3000:]
        pids = [launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))]
        assert len(pids) == 5, pids  # launcher, HTTP guard, tritonserver, stub, engine core
        clients = _load(server)
        if signum == signal.SIGINT:
            os.killpg(launcher.pid, signum)
        else:
            launcher.send_signal(signum)
        threading.Thread(target=launcher.wait, daemon=True).start()  # reap it
        _assert_gone_within_bound(pids, signum.name)
        for client in clients:
            client.cancel()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


TRITON_ABORT_ON_DEAD_STUB = (
    "terminate called after throwing an instance of 'boost::interprocess::lock_exception'"
)


def test_make_serve_exits_non_zero_when_a_stub_dies_but_not_on_an_unload(tmp_path):
    """Triton 2.51 keeps a model READY after its stub was killed, and never ends the requests it had.
    `make serve`'s launcher watches the stubs: an unload (the model is no longer ready) and a load
    pass; a kill -9 of the stub with streams in flight stops the server, every process of ours
    goes, and the launcher exits with DEAD_STUB_EXIT_STATUS so a supervisor restarts it."""
    launcher, server = _start_launcher(tmp_path, ["--model-control-mode=explicit", "--load-model=llm"])
    try:
        assert wait_for(server.is_ready, timeout_s=180, interval_s=0.25), server.log()[-3000:]
        assert http_post(server.http_url, "/v2/repository/models/llm/unload", {})[0] == 200
        assert wait_for(lambda: not _stubs(launcher.pid), timeout_s=60)
        assert http_post(server.http_url, "/v2/repository/models/llm/load", {}, timeout_s=120)[0] == 200
        time.sleep(2 * STUB_CHECK_INTERVAL_S)  # the watch has seen the unload and the new stub
        assert launcher.poll() is None, server.log()[-3000:]
        stubs = _stubs(launcher.pid)
        assert len(stubs) == 1
        pids = [launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))]
        clients = _load(server)
        stubs[0].kill()
        status = launcher.wait(timeout=EXIT_BOUND_S + 15)
        if status == 128 + signal.SIGABRT and TRITON_ABORT_ON_DEAD_STUB in server.log():
            # Triton itself aborted: the stub died holding the lock of its shared-memory region (a
            # Triton 2.51 defect; seen once in CI). Still a non-zero exit and nothing left behind.
            assert "paged_llm: tritonserver was ended by SIGABRT" in server.log()
        else:
            assert status == DEAD_STUB_EXIT_STATUS, server.log()[-3000:]
            assert "the Python stub of instance llm_0_0 of model 'llm' (version 1)" in server.log()
        _assert_gone_within_bound(pids, "the launcher's exit")
        for client in clients:
            client.cancel()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_server_that_fails_on_a_busy_port_after_loading_leaves_nothing(tmp_path):
    """tritonserver binds its ports only after loading every model; when one is taken (here
    the gRPC port, held by a listener as another server would hold it) it fails and exits, and
    the loaded stub and its engine core must not outlive it (`launch serve` checks the ports
    first; a server started otherwise, or a port taken in between, ends up here)."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    http, grpc, metrics = free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc))
        taken.listen()
        command = server_command(repository, ServerPorts(http, grpc, metrics), exit_timeout_secs=3)
        log = open(tmp_path / "server.log", "w")
        server = subprocess.Popen(command, env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            seen: set[int] = set()

            def exited() -> bool:
                if server.poll() is None:
                    seen.update(p.pid for p in psutil.Process(server.pid).children(recursive=True))
                return server.poll() is not None

            assert wait_for(exited, timeout_s=180, interval_s=0.1)
            log_text = (tmp_path / "server.log").read_text()
            assert "paged_llm" in log_text and "Address already in use" in log_text, log_text[-3000:]
            assert seen, "the model never started loading"
            _assert_gone_within_bound(sorted(seen), "tritonserver's exit on a busy port")
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _stubs(launcher_pid: int) -> list[psutil.Process]:
    return live_children_named(launcher_pid, "triton_python_backend_stub", recursive=True)


def test_a_test_run_killed_hard_leaves_no_server_behind(tmp_path):
    """start_server's servers die with the process that started them (a pytest or benchmark run
    killed with SIGKILL): tritonserver, stub and core all gone within the bound."""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    script = (
        "import sys, time; from pathlib import Path; "
        "from paged_llm.testing.server_process import start_server; "
        "server = start_server(Path(sys.argv[1]), Path(sys.argv[2])); "
        "print(server.process.pid, flush=True); time.sleep(600)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(repository), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        server_pid = int(owner.stdout.readline())
        children = psutil.Process(server_pid).children(recursive=True)
        pids = [server_pid, *(p.pid for p in children)]
        assert len(pids) == 3, pids  # tritonserver, stub, engine core
        owner.kill()
        owner.wait()
        _assert_gone_within_bound(pids, "SIGKILL of the process that started the server")
    finally:
        if owner.poll() is None:
            owner.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_server_stopped_while_the_model_loads_leaves_no_process_of_ours(tmp_path, signum):
    """SIGTERM or SIGKILL of tritonserver while the stub is inside initialize() (its engine core is
    starting): stub and core are gone within the bound. (A pb_utils call in initialize, e.g.
    creating a metric, blocks for ever once the server stopped answering.)"""
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    http, grpc, metrics = free_ports(3)
    command = server_command(repository, ServerPorts(http, grpc, metrics), exit_timeout_secs=3)
    log = open(tmp_path / "server.log", "w")  # the server writes it while it runs
    server = subprocess.Popen(command, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    try:

        def core_ready() -> bool:  # the core's first log line: the stub is about to create its metrics
            return "paged_llm engine core:" in (tmp_path / "server.log").read_text(errors="replace")

        assert wait_for(core_ready, timeout_s=120, interval_s=0.01)
        pids = [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
        assert len(pids) == 2, pids  # stub, engine core
        server.send_signal(signum)
        threading.Thread(target=server.wait, daemon=True).start()  # reap it
        _assert_gone_within_bound(pids, f"{signum.name} to tritonserver during model load")
    finally:
        if server.poll() is None:
            server.kill()


def test_shared_memory_of_a_killed_server_is_removed_afterwards(tmp_path):
    started = time.time() - 1.0
    repository = make_model_repository(tmp_path / "models", models=("llm",))
    running = start_server(repository, tmp_path / "server.log")
    stubs = our_processes(running)["stubs"]
    regions = [arg for stub in stubs for arg in stub.cmdline() if arg.startswith("triton_python_backend_shm")]
    assert len(regions) == 1, regions
    region = SHM_DIR / regions[0]
    pids = [
        running.process.pid,
        *(p.pid for p in psutil.Process(running.process.pid).children(recursive=True)),
    ]
    os.killpg(running.process.pid, signal.SIGKILL)
    running.process.wait()
    _assert_gone_within_bound(pids, "SIGKILL of the server's process group")
    assert region.exists(), "a SIGKILLed server leaves its region (else this test tests nothing)"
    assert region in remove_orphaned_shm_regions(changed_since=started)
    assert not region.exists()


def test_two_instances_share_one_engine_core_and_stop_cleanly(tmp_path):
    """instance_group count 2: two stubs (each sends its own requests' responses) and one engine
    core; every stream is token-exact; SIGTERM leaves none of the three."""
    repository = make_model_repository(
        tmp_path / "models", {"max_merged_steps": "1"}, models=("llm",), instance_count=2
    )
    running = start_server(repository, tmp_path / "server.log")
    try:
        ours = our_processes(running)
        assert len(ours["stubs"]) == 2 and len(ours["cores"]) == 1, ours
        assert "attached to the shared engine core" in running.log()
        params = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}
        prompts = [f"shared core {index % 4}" for index in range(16)]
        clients = [StreamClient(running.grpc_url) for _ in prompts]
        for index, (client, prompt) in enumerate(zip(clients, prompts)):
            client.send(f"c{index}", prompt, stream=True, sampling_parameters=params)
        texts = []
        for client in clients:
            text = ""
            while True:
                result, error = client.next(timeout_s=60)
                assert error is None, error
                if result.as_numpy("text_output") is not None:
                    text += "".join(t.decode() for t in result.as_numpy("text_output"))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            texts.append(text)
            client.client.close()
        expected = {
            prompt: stream(
                running.grpc_url, prompt, sampling_parameters=params, exclude_input_in_output=True
            ).text
            for prompt in set(prompts)
        }
        assert texts == [expected[prompt] for prompt in prompts]
        pids = [p.pid for p in ours["stubs"] + ours["cores"]]
        os.kill(running.process.pid, signal.SIGTERM)
        _assert_gone_within_bound(pids, "SIGTERM")
    finally:
        running.stop()


# Each cycle is a server start (~10-14 s on the 2-core CI machine); 20 took ~4.7 of CI's minutes.
# PAGED_LLM_STRESS_CYCLES=20 runs issue "Hardening"'s full count by hand.
STRESS_CYCLES_DEFAULT = 8


def stress_cycles() -> int:
    text = os.environ.get("PAGED_LLM_STRESS_CYCLES", str(STRESS_CYCLES_DEFAULT))
    if not text.isdigit() or int(text) < 1:
        pytest.fail(f"PAGED_LLM_STRESS_CYCLES must be a whole number >= 1, got {text!r}")
    return int(text)


def test_repeated_start_load_sigterm_cycles_leave_nothing_and_stop_in_time(tmp_path):
    """Issue "Hardening" row 7 (a SIGTERM after varied requests once left llm loaded and processes
    alive): stress_cycles() times start a server with llm and llm_trtllm, put mixed load on it (gRPC
    streams on both models, an HTTP generate_stream, a cancelled stream), SIGTERM it with that load
    in flight. Every time: the server exits within its exit timeout (+ a margin for a loaded
    machine), llm is finalized, and no process of ours is left."""
    repository = make_model_repository(tmp_path / "models")
    for cycle in range(stress_cycles()):
        _start_load_sigterm(repository, tmp_path / f"server_{cycle}.log", cycle)


def _start_load_sigterm(repository, log_path, cycle: int) -> None:
    from tests.e2e.test_api import _trt_inputs

    exit_timeout_s, stop_margin_s = 3, 7.0  # start_server's --exit-timeout-secs; a loaded machine
    server = start_server(repository, log_path)
    try:
        children = psutil.Process(server.process.pid).children(recursive=True)
        pids = [server.process.pid, *(p.pid for p in children)]
        assert len(pids) == 4, pids  # tritonserver, two stubs, llm's engine core
        clients = _load(server, count=3)
        trt = StreamClient(server.grpc_url)
        trt.client.async_stream_infer(
            "llm_trtllm", _trt_inputs(f"stress {cycle}", max_tokens=3000, min_length=3000, stream=True),
            request_id=f"t{cycle}", enable_empty_final_response=True,
        )  # fmt: skip
        cancelled = StreamClient(server.grpc_url)
        cancelled.send(f"c{cycle}", "to be cancelled", stream=True, sampling_parameters=LONG)
        body = {"text_input": "over http", "max_tokens": 3000, "ignore_eos": True}
        route = "/v2/models/llm/generate_stream"
        threading.Thread(
            target=_ignore_errors, args=(http_post, server.http_url, route, body, 30), daemon=True
        ).start()
        trt.next()
        cancelled.next()
        cancelled.cancel()
        stopped_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for client in [*clients, trt]:
            client.client.close()
        exited = wait_for(lambda: server.process.poll() is not None, exit_timeout_s + stop_margin_s, 0.1)
        took = time.monotonic() - stopped_at
        assert exited, f"cycle {cycle}: tritonserver still running {took:.1f} s after SIGTERM"
        _assert_gone_within_bound(pids, f"SIGTERM, cycle {cycle}")
        log = log_path.read_text()
        assert log.count("paged_llm finalized") == 1, f"cycle {cycle}: llm not finalized\n{log[-3000:]}"
    finally:
        server.stop()


def _ignore_errors(function, *args) -> None:
    try:
        function(*args)
    except Exception:
        pass


def test_make_serve_removes_the_shared_memory_its_killed_server_left(tmp_path):
    """Triton removes a stub's /dev/shm region when it finalizes the model, so a killed server (or
    one that exits with a model whose unload never finished: README, Known limits) leaves it
    behind; `make serve`'s launcher removes its stubs' regions once nothing uses them."""
    launcher, server = _start_launcher(tmp_path)
    try:
        assert wait_for(server.is_ready, timeout_s=180, interval_s=0.25), server.log()[-3000:]
        [stub] = _stubs(launcher.pid)
        [region] = [arg for arg in stub.cmdline() if arg.startswith("triton_python_backend_shm_region_")]
        time.sleep(2 * STUB_CHECK_INTERVAL_S)  # the launcher has seen the stub
        # (the launcher's other child is its HTTP guard)
        [tritonserver] = live_children_named(launcher.pid, "tritonserver")
        tritonserver.kill()
        assert launcher.wait(timeout=60) != 0
        assert not stub.is_running() or stub.status() == psutil.STATUS_ZOMBIE
        assert not (SHM_DIR / region).exists(), "the launcher left its server's region"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
