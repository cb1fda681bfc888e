"""Runs tritonserver as a child and makes sure that stopping it stops it, for `make serve`.

tritonserver 2.51 handles SIGINT / SIGTERM by unloading its models for up to --exit-timeout-secs,
but it hangs in its own teardown when it gives up on a model that a client's open gRPC stream keeps
alive (triton_model/server_watch.py). So: the first SIGINT or SIGTERM is passed on (Ctrl-C reaches the
whole process group anyway); if the server has not exited `grace_s` after its exit timeout, it and
whatever it started are killed. The exit status is the server's (128 + signal if it was killed).

tritonserver can also die on its own of a dead stub: a stub killed while it holds the lock of its
shared-memory region makes Triton 2.51 abort (`boost::interprocess::lock_exception`, SIGABRT), so
the launcher then exits with 134 instead of DEAD_STUB_EXIT_STATUS; both are failures to restart on.

With `http_url`, the stubs below the server are watched (launcher/stub_watch.py): a stub that dies
while Triton still calls its model ready stops the server the same way, and the exit status is
then DEAD_STUB_EXIT_STATUS, so that a supervisor (systemd, Kubernetes) restarts it.

The shared-memory regions of the server's stubs (seen every STUB_CHECK_INTERVAL_S) are removed once
the server has exited and nothing uses them: Triton leaves them in /dev/shm when it is killed or
exits with a model it never finished unloading (launcher/shm_regions.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable

from paged_llm.launcher.procfs import descendants, kill_hard
from paged_llm.launcher.shm_regions import remove_unused_regions, stub_regions
from paged_llm.launcher.stub_watch import StubWatch

KILL_MARGIN_S = 2.0  # after the server's own exit timeout
STUB_CHECK_INTERVAL_S = 1.0
DEAD_STUB_EXIT_STATUS = 3


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds: `take()` is True and counts one
    while the budget allows another, False once `limit` restarts fall within the window."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()

    def take(self) -> bool:
        now = self._clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True

    @property
    def used(self) -> int:
        return len(self._times)

    def describe(self) -> str:
        return f"restart {self.used} of at most {self.limit} within {self.window_s:.0f} s"


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + signal when a signal ended it (Popen's negative
    returncode would otherwise wrap around, e.g. -6 to 250)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_server_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"tritonserver was ended by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"tritonserver was ended by signal {-returncode}"
    return f"tritonserver exited with status {returncode}"


def run_supervised(
    command: list[str], env: dict[str, str], exit_timeout_s: float, http_url: str | None = None
) -> int:
    regions: set[str] = set()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_supervised(command, env, exit_timeout_s, http_url, regions)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        remove_unused_regions(regions)


def _run_supervised(
    command: list[str], env: dict[str, str], exit_timeout_s: float, http_url: str | None, regions: set[str]
) -> int:
    process = subprocess.Popen(command, env=env)
    kill_at: list[float] = []  # set by the first stop signal
    dead_stub: list[str] = []
    watch = StubWatch(process.pid, http_url) if http_url else None
    next_check = time.monotonic() + STUB_CHECK_INTERVAL_S

    def stop(signum: int) -> None:
        if not kill_at:
            kill_at.append(time.monotonic() + exit_timeout_s + KILL_MARGIN_S)
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGINT, lambda signum, _frame: stop(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop(signum))
    while True:
        try:
            returncode = process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        else:
            if not kill_at and returncode != 0:  # nobody asked it to stop
                print(f"paged_llm: {describe_server_exit(returncode)}", file=sys.stderr, flush=True)
            return DEAD_STUB_EXIT_STATUS if dead_stub else exit_status(returncode)
        if kill_at and time.monotonic() >= kill_at[0]:
            break
        if not kill_at and time.monotonic() >= next_check:
            next_check = time.monotonic() + STUB_CHECK_INTERVAL_S
            regions.update(stub_regions(process.pid))
            if watch is not None:
                dead_stub = watch.check()
                for message in dead_stub:
                    print(f"paged_llm: {message}: stopping the server", file=sys.stderr, flush=True)
                if dead_stub:
                    stop(signal.SIGTERM)
    stuck = [process.pid, *descendants(process.pid)]
    print(
        f"paged_llm: tritonserver did not exit within {exit_timeout_s:.0f} s + {KILL_MARGIN_S:.0f} s of the "
        "stop signal (Triton 2.51 hangs when a client keeps a gRPC stream open): killing it",
        file=sys.stderr,
        flush=True,
    )
    kill_hard(stuck)
    returncode = process.wait()
    return DEAD_STUB_EXIT_STATUS if dead_stub else exit_status(returncode)
