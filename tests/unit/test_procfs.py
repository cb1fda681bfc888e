"""/proc reading shared by the launchers' supervision (launcher/procfs.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from paged_llm.launcher.launch import ServerPorts
from paged_llm.launcher.procfs import descendants, kill_hard, process_group_members, processes
from paged_llm.testing.server_process import RunningServer


def test_descendants_include_grandchildren_and_processes_see_parents():
    # a child that starts a grandchild, prints its pid, then waits for it
    script = (
        "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); p.wait()"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        below = descendants(os.getpid())
        assert child.pid in below and grandchild in below
        by_pid = {p.pid: p for p in processes()}
        assert by_pid[grandchild].parent_pid == child.pid and by_pid[grandchild].is_alive
        assert descendants(grandchild) == []
    finally:
        os.kill(grandchild, 9)
        child.wait(timeout=30)


# A group leader that exits at once on SIGTERM, with a child that ignores SIGTERM: a server whose
# stub outlives it. The child says when its handler is set, so no SIGTERM can come before it.
_LEADER_WITH_STUBBORN_CHILD = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(flush=True); time.sleep(120)'], "
    "stdout=subprocess.PIPE); child.stdout.readline(); print(child.pid, flush=True); time.sleep(120)"
)


def test_process_group_members_outlive_the_leader_and_stop_waits_for_them_then_kills_them(tmp_path):
    command = [sys.executable, "-c", _LEADER_WITH_STUBBORN_CHILD]
    leader = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child_pid = int(leader.stdout.readline())
        assert sorted(process_group_members(leader.pid)) == sorted([leader.pid, child_pid])
        server = RunningServer(leader, ServerPorts(0, 0, 0), Path(tmp_path / "log"))
        started = time.monotonic()
        server.stop(timeout_s=30.0, stragglers_timeout_s=0.5)
        assert leader.returncode == -signal.SIGTERM
        assert process_group_members(leader.pid) == []  # the child ignored SIGTERM and got SIGKILL
        assert time.monotonic() - started >= 0.5  # it was given its time first
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        leader.wait(timeout=30)


def test_kill_hard_kills_each_and_skips_the_gone():

    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    gone = subprocess.Popen(["true"])
    gone.wait()
    kill_hard([gone.pid, *(p.pid for p in sleepers)])  # gone first: the others still die
    assert [p.wait(timeout=10) for p in sleepers] == [-signal.SIGKILL] * 2
