"""ServerDeathWatch: the stub leaves once tritonserver is no longer its parent; stop() ends the
watch so that no thread of ours outlives finalize() (triton_model/server_watch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from paged_llm.triton_model.server_watch import ServerDeathWatch


def test_the_watch_of_a_live_parent_runs_until_stopped():
    watch = ServerDeathWatch(os.getppid(), interval_s=0.01)
    try:
        assert watch.is_alive()
    finally:
        watch.stop()
    assert not watch.is_alive()


def test_a_process_whose_parent_is_not_the_server_exits_with_status_1():
    code = textwrap.dedent(
        """
        import os, time
        from paged_llm.triton_model.server_watch import ServerDeathWatch
        ServerDeathWatch(os.getppid() + 1_000_000, interval_s=0.01)  # a pid that is not our parent
        time.sleep(60)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "tritonserver is gone; the stub exits" in done.stderr
