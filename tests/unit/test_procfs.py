"""/proc reading shared by the launchers' supervision (tools/procfs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from paged_llm.tools.procfs import descendants, processes


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
