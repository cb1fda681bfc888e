"""Several OpenAI server processes on one port, each with its own SO_REUSEPORT listening socket.

uvicorn's own `--workers` shares one listening socket between its processes, and which process
accepts a new connection is up to whichever wakes first: measured with 64 keep-alive connections
opened at once to 6 workers, one process got 28-42 of them while others got 1-7 (the benchmark
clients, like most, keep their connections for the whole run). With a socket per process and
SO_REUSEPORT, the kernel spreads connections over the processes by their addresses' hash.

The parent starts the workers, restarts one that dies (unless they keep dying), and on SIGINT or
SIGTERM sends each worker one SIGTERM (uvicorn's graceful shutdown; a second signal would cut it
short, so the workers run in their own process groups and do not also get the terminal's Ctrl-C).
Each worker gets SIGTERM from the kernel if the parent dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

from paged_llm.processes import parent_death_signal

logger = logging.getLogger(__name__)
_STOP_WAIT_S = 8.0  # uvicorn's graceful shutdown of 3 s, plus its own exit
_MAX_RESTARTS = 5  # within _RESTART_WINDOW_S: then the workers are failing, not crashing once
_RESTART_WINDOW_S = 60.0
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, so each worker has its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _worker_main(app_factory: str, host: str, port: int, options: dict[str, Any]) -> None:
    os.setpgrp()  # the terminal's Ctrl-C reaches the parent only, which sends one SIGTERM
    stop_with_parent = parent_death_signal(signal.SIGTERM)
    if stop_with_parent is not None:
        stop_with_parent()
    if os.getppid() == 1:  # the parent died before the line above
        return
    # (a spawned process starts with logging unconfigured: the parent's basicConfig is not inherited)
    logging.basicConfig(level=str(options.get("log_level", "warning")).upper(), format=LOG_FORMAT)
    import uvicorn

    sock = listening_socket(host, port)
    config = uvicorn.Config(app_factory, factory=True, **options)
    uvicorn.Server(config).run(sockets=[sock])


def run_workers(num_workers: int, app_factory: str, host: str, port: int, options: dict[str, Any]) -> int:
    """Runs `num_workers` processes serving `app_factory` (uvicorn "module:function") until a stop
    signal; 0 then, 1 if the workers kept dying."""
    context = multiprocessing.get_context("spawn")
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def start() -> Any:
        process = context.Process(
            target=_worker_main, args=(app_factory, host, port, options), name="paged_llm-openai-worker"
        )
        process.start()
        return process

    workers = [start() for _ in range(num_workers)]
    restarts: deque[float] = deque()
    status = 0
    try:
        while not stopping:
            multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.5)
            for index, worker in enumerate(workers):
                if worker.is_alive() or stopping:
                    continue
                now = time.monotonic()
                while restarts and now - restarts[0] > _RESTART_WINDOW_S:
                    restarts.popleft()
                if len(restarts) >= _MAX_RESTARTS:
                    print(
                        f"paged_llm.openai: workers keep exiting (the last with code {worker.exitcode}); "
                        "stopping",
                        file=sys.stderr,
                    )
                    status = 1
                    stopping.append(signal.SIGTERM)
                    break
                logger.warning(
                    "OpenAI server worker %d exited (%s); restarting it", worker.pid, worker.exitcode
                )
                restarts.append(now)
                workers[index] = start()
    finally:
        _stop(workers)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status


def _stop(workers: list[Any]) -> None:
    for worker in workers:
        if worker.is_alive():
            try:
                os.kill(worker.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _STOP_WAIT_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join(2.0)
