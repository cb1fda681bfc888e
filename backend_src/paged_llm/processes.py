"""What every process of the server shares about its children and its parent: which interpreter a
child runs in, how a child is started (`python -m`, this package first on its path), and how a
process ends with its parent (the kernel's parent-death signal, a watchdog thread) or tells whether
another process is still alive.

The engine core (engine/engine_core/process.py), the tensor-parallel workers (runner/tp_worker.py), the
OpenAI server's workers and the launcher all start or watch processes through here.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5  # how often a watchdog looks: a dead parent is noticed within this


def python_executable() -> str:
    """The interpreter to start a child with. Inside Triton's stub `sys.executable` may be the stub
    binary, so fall back to this environment's own `bin/python3`, then to `python3` on PATH (the
    interpreter whose environment the stub itself uses)."""
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    for candidate in (
        Path(sys.exec_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}",
        Path(sys.exec_prefix) / "bin" / "python3",
    ):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError("cannot find a python3 executable to start the engine core process")
    return found


def spawn_module(
    module: str, args: Sequence[str], python: str | None = None, **popen: Any
) -> subprocess.Popen:
    """Starts `python -m module args` in a fresh interpreter (never forked: CUDA), with this package
    first on its path, so the child runs the same code as its parent whatever its working directory.
    `python`: the interpreter (default python_executable()); `popen`: more subprocess.Popen arguments."""
    package_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    command = [python or python_executable(), "-m", module, *args]
    return subprocess.Popen(command, env=env, **popen)


def parent_death_signal(signum: int) -> Callable[[], None] | None:
    """A function that makes the kernel send the calling process `signum` when the thread that
    started it exits, or None where that is not available (not Linux). libc is looked up here, so
    the function can run as a subprocess preexec_fn (in the forked child it only makes the call)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def watch_parent(
    parent_pid: int,
    on_parent_gone: Callable[[], None],
    thread_name: str,
    watch_pid: int | None = None,
    on_watched_gone: Callable[[], None] | None = None,
) -> None:
    """Starts a daemon thread that calls `on_parent_gone` once this process's parent is no longer
    `parent_pid` (where the parent-death signal is missing, or arrives late), and `on_watched_gone`
    once `watch_pid` exited. Each callback is expected to end the process."""

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if os.getppid() != parent_pid:
                on_parent_gone()
            if watch_pid is not None and on_watched_gone is not None and not process_is_alive(watch_pid):
                on_watched_gone()

    threading.Thread(target=watch, name=thread_name, daemon=True).start()


def process_is_alive(pid: int) -> bool:
    """False once `pid` exited (a zombie waiting for its parent to reap it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
