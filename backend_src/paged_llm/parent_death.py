"""Processes that must not outlive their parent: the kernel's parent-death signal (Linux prctl)."""

from __future__ import annotations

import ctypes
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
