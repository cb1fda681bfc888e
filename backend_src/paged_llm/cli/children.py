"""The processes `paged-llm serve` runs (tritonserver, the OpenAI server, the HTTP guard): waiting
for them to be ready, watching them, restarting tritonserver, stopping them all."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from paged_llm.launcher.guard_process import stop_guard
from paged_llm.launcher.launch import port_bind_error
from paged_llm.launcher.procfs import descendants, kill_hard
from paged_llm.launcher.shm_regions import remove_unused_regions, stub_regions
from paged_llm.launcher.stub_watch import StubWatch
from paged_llm.launcher.supervise import (
    DEAD_STUB_EXIT_STATUS,
    KILL_MARGIN_S,
    RestartBudget,
    describe_server_exit,
    exit_status,
)

EXIT_TIMEOUT_S = 5  # tritonserver's --exit-timeout-secs
POLL_S = 0.25


@dataclass
class Children:
    server: subprocess.Popen
    openai_server: subprocess.Popen | None = None
    guard: subprocess.Popen | None = None  # the HTTP guard on the public HTTP and metrics ports
    regions: set[str] = field(default_factory=set)  # the stubs' shared memory, removed after exit


def get_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception:  # not listening yet, a reset, a malformed answer: not ready
        return None


def stop_children(children: Children, signum: int) -> None:
    for process in (children.openai_server, children.server):
        if process is not None and process.poll() is None:
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass


def wait_until(check, process: subprocess.Popen, timeout_s: float, stopping: list[int]) -> bool:
    """Polls `check()` until it holds; False if `process` exited, a stop signal came, or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping and process.poll() is None:
        if check():
            return True
        time.sleep(POLL_S)
    return False


def stop_all(children: Children, signum: int) -> None:
    """Signals both children and waits for them; kills what is still there after tritonserver's
    exit timeout (and whatever it started)."""
    stop_children(children, signum)
    children.regions.update(stub_regions(children.server.pid))
    kill_at = time.monotonic() + EXIT_TIMEOUT_S + KILL_MARGIN_S
    for process in (children.openai_server, children.server):
        if process is None:
            continue
        try:
            process.wait(timeout=max(0.1, kill_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"paged-llm: pid {process.pid} did not exit in time: killing it", file=sys.stderr)
            kill_hard([process.pid, *descendants(process.pid)])
            process.wait()
    stop_guard(children.guard)
    remove_unused_regions(children.regions)


def supervise(
    children: Children,
    watch: StubWatch,
    stopping: list[int],
    restart: Callable[[], subprocess.Popen],
    budget: RestartBudget,
) -> int:
    """Runs until a stop signal or until a child exits; then stops both and returns the status.
    A tritonserver that exits on its own, or one with a dead stub (Triton 2.51 never restarts a
    stub), is replaced by a fresh one on the same ports while `budget` allows; the OpenAI server
    keeps running meanwhile (its /health answers 503 until Triton serves again)."""
    next_check = time.monotonic()
    failure = 0
    while not stopping:
        death: tuple[str, int] | None = None  # (what happened, the exit status it would give)
        if children.server.poll() is not None:
            returncode = children.server.returncode
            death = (describe_server_exit(returncode), exit_status(returncode) or 1)
        elif children.openai_server is not None and children.openai_server.poll() is not None:
            failure = 1
            returncode = children.openai_server.returncode
            print(f"paged-llm: the OpenAI server exited ({returncode})", file=sys.stderr)
            break
        elif children.guard is not None and children.guard.poll() is not None:
            failure = 1
            print(f"paged-llm: the HTTP guard exited ({children.guard.returncode})", file=sys.stderr)
            break
        elif children.openai_server is None:  # startup failed or timed out
            failure = 1
            print("paged-llm: the model did not become ready; stopping", file=sys.stderr)
            break
        elif time.monotonic() >= next_check:
            next_check = time.monotonic() + 1.0
            children.regions.update(stub_regions(children.server.pid))
            dead = watch.check()
            if dead:
                death = ("; ".join(dead), DEAD_STUB_EXIT_STATUS)
                try:  # a killed tritonserver's stubs leave its process tree before it is reaped
                    returncode = children.server.wait(timeout=1.0)
                    death = (describe_server_exit(returncode), exit_status(returncode) or 1)
                except subprocess.TimeoutExpired:
                    pass
        if death is not None:
            message, status = death
            if not budget.take():
                print(
                    f"paged-llm: {message}; {budget.limit} restarts within {budget.window_s:.0f} s already: "
                    "stopping",
                    file=sys.stderr,
                    flush=True,
                )
                failure = status
                break
            print(
                f"paged-llm: {message}: restarting tritonserver ({budget.describe()})",
                file=sys.stderr,
                flush=True,
            )
            stop_server(children)
            if stopping:
                break
            children.server = restart()
            watch = StubWatch(children.server.pid, watch.http_url)
            continue
        time.sleep(POLL_S)
    stop_all(children, stopping[0] if stopping else signal.SIGTERM)
    return failure


def stop_server(children: Children) -> None:
    """Stops tritonserver alone (SIGTERM, then SIGKILL for it and what it started after its exit
    timeout) and removes its stubs' shared memory once unused."""
    server = children.server
    children.regions.update(stub_regions(server.pid))
    stragglers = descendants(server.pid)
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=EXIT_TIMEOUT_S + KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            print(
                f"paged-llm: tritonserver (pid {server.pid}) did not exit in time: killing it",
                file=sys.stderr,
            )
            stragglers = [server.pid, *descendants(server.pid)]
    kill_hard(stragglers)
    server.wait()
    remove_unused_regions(children.regions)
    children.regions.clear()


def wait_for_ports(ports: list[tuple[str, int]], timeout_s: float = 60.0) -> None:
    """Until each (address, port) can be bound: the old server's listeners are gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(port_bind_error(address, port) is None for address, port in ports):
            return
        time.sleep(POLL_S)
