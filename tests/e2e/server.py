"""Test model repositories and servers (the harness lives in paged_llm.testing.server_process)."""

from __future__ import annotations

import psutil

from paged_llm.launcher.repository import make_model_repository
from paged_llm.testing.server_process import RunningServer, free_ports, start_server

__all__ = ["RunningServer", "free_ports", "live_children_named", "make_model_repository", "start_server"]


def live_children_named(pid: int, name: str, recursive: bool = False) -> list[psutil.Process]:
    """`pid`'s live children called `name`. A child listed a moment ago may be gone by the time it
    is asked its name (a stub exiting on an unload): that one is not live."""
    found = []
    for child in psutil.Process(pid).children(recursive=recursive):
        try:
            if child.name() == name and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:  # ZombieProcess included
            continue
    return found
