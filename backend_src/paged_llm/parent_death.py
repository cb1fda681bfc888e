"""Processes that must not outlive their parent: the kernel's parent-death signal (Linux prctl), and
whether a process is still alive."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def parent_death_signal(signum: int) -> Callable[[], None] | None:
    """A function that makes the kernel send the calling process `signum` when the thread that
    started it exits, or None where that is not available (not Linux). libc is looked up here, so
    the function can run as a subprocess preexec_fn (in the forked child it only makes the call)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


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
