"""Reading the process table from /proc (Linux; empty results where /proc is missing), and killing
what it finds."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStat:
    pid: int
    parent_pid: int
    state: bytes  # b"R", b"S", ..., b"Z" (zombie), b"X" (dead)
    group_id: int  # the process group

    @property
    def is_alive(self) -> bool:
        return self.state not in (b"Z", b"X")


def read_proc(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as file:
            return file.read()
    except OSError:
        return None


def processes() -> Iterator[ProcStat]:
    """Every process now (one that exits while it is read is skipped)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        stat = read_proc(int(entry), "stat")
        if stat is None:
            continue
        try:  # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses
            fields = stat.rsplit(b")", 1)[1].split()
            yield ProcStat(int(entry), int(fields[1]), fields[0], int(fields[2]))
        except (IndexError, ValueError):
            continue


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for process in processes():
        children.setdefault(process.parent_pid, []).append(process.pid)
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def process_group_members(group_id: int) -> list[int]:
    """The live processes (zombies left out) of a process group, which outlives its leader while
    any member lives."""
    return [p.pid for p in processes() if p.group_id == group_id and p.is_alive]


def live_processes_running(command_part: bytes) -> list[int]:
    """The live processes whose command line contains `command_part` (e.g. a `-m` module name)."""
    return [p.pid for p in processes() if p.is_alive and command_part in (read_proc(p.pid, "cmdline") or b"")]


def kill_hard(pids: Iterable[int]) -> None:
    """SIGKILL each of `pids`; one that is gone already is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
