"""Notices a Python-backend stub that died while Triton still calls its model ready.

Triton 2.51 does not restart a stub that crashed or was killed: its model stays READY, the ready
endpoints answer 200, requests in flight never get a final response and every new one fails with
"Stub process '<instance>' is not healthy". From the outside only the process tree tells. So the
launcher (`make serve`) watches the stubs below tritonserver:

    stub process seen (cmdline: stub <repo>/<model>/<version>/model.py ... <instance> ...)
      -> gone (or a zombie), no live stub of the same instance took its place (a reload starts the
         new stub before the old one exits), and the model version still answers ready
      -> dead: the launcher stops the server and exits non-zero so a supervisor restarts it.

An unload (explicit model control) also ends a stub, but then the model is no longer ready.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from paged_llm.launcher.procfs import processes, read_proc

STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class StubInstance:
    model: str
    version: str
    instance: str  # Triton's instance name, e.g. llm_0_0

    def __str__(self) -> str:
        return f"instance {self.instance} of model '{self.model}' (version {self.version})"


def parse_stub_cmdline(args: list[str]) -> StubInstance | None:
    """The instance a stub serves, from its argv: `stub <model dir>/<version>/model.py <shm region>
    <size> <growth> <parent pid> <backend dir> <ipc handle> <instance name> <kind>`."""
    if len(args) < 9 or Path(args[0]).name != STUB_NAME:
        return None
    model_file = Path(args[1])
    return StubInstance(model=model_file.parent.parent.name, version=model_file.parent.name, instance=args[8])


def live_stubs(server_pid: int) -> dict[int, StubInstance]:
    """The stubs among tritonserver's children that are alive (zombies count as dead)."""
    stubs: dict[int, StubInstance] = {}
    for process in processes():
        if process.parent_pid != server_pid or not process.is_alive:
            continue
        cmdline = read_proc(process.pid, "cmdline")
        stub = parse_stub_cmdline(cmdline.decode(errors="replace").split("\0")) if cmdline else None
        if stub is not None:
            stubs[process.pid] = stub
    return stubs


def model_is_ready(http_url: str, stub: StubInstance, timeout_s: float = 2.0) -> bool | None:
    """Triton's readiness of the stub's model version; None when the server does not answer."""
    url = f"{http_url}/v2/models/{stub.model}/versions/{stub.version}/ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False
    except OSError:
        return None


class StubWatch:
    """`check()` returns a message for each stub that died under a model Triton still calls ready."""

    def __init__(
        self,
        server_pid: int,
        http_url: str,
        list_stubs: Callable[[int], dict[int, StubInstance]] = live_stubs,
        is_ready: Callable[[str, StubInstance], bool | None] = model_is_ready,
    ) -> None:
        self.server_pid = server_pid
        self.http_url = http_url
        self._list_stubs = list_stubs
        self._is_ready = is_ready
        self._known: dict[int, StubInstance] = {}
        self._unjudged: dict[int, StubInstance] = {}  # vanished while Triton did not answer
        # Set once Triton has answered (or by a caller that saw it ready): before that, a stub that
        # vanishes unanswered is one of a loading server (Triton starts and ends stubs to complete
        # model configs) and is not judged.
        self.server_up = False

    def check(self) -> list[str]:
        alive = self._list_stubs(self.server_pid)
        vanished = {pid: stub for pid, stub in self._known.items() if pid not in alive}
        vanished.update(self._unjudged)
        self._unjudged = {}
        self._known = dict(alive)
        return self._dead(vanished.items(), set(alive.values()))

    def _dead(self, vanished: Iterable[tuple[int, StubInstance]], alive: set[StubInstance]) -> list[str]:
        messages = []
        for pid, stub in vanished:
            if stub in alive:  # replaced by a new stub of the same instance (a reload)
                continue
            ready = self._is_ready(self.http_url, stub)
            if ready is None:
                if self.server_up:  # no answer from a server that was up (busy): judged next time
                    self._unjudged[pid] = stub
                continue
            self.server_up = True
            if ready:  # not ready: unloaded, not ours to judge
                messages.append(
                    f"the Python stub of {stub} (pid {pid}) died while Triton still reports the model "
                    "ready; Triton 2.51 does not restart it, its requests in flight never finish and new "
                    "ones fail"
                )
        return messages
