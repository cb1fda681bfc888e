from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from paged_llm.launcher.repository import TRTLLM_MODEL_NAMES
from paged_llm.launcher.shm_regions import remove_orphaned_shm_regions
from tests.e2e.server import RunningServer, make_model_repository, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RunningServer]:
    """One tritonserver on the project's model repository (tiny model), shared by the e2e tests."""
    root = tmp_path_factory.mktemp("triton")
    repository = make_model_repository(root / "models", models=("llm", *TRTLLM_MODEL_NAMES))
    running = start_server(repository, root / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Servers that tests kill with SIGKILL cannot remove their Python-backend shared memory: after
    the session, remove the regions touched during it that no process uses any more."""
    started = time.time() - 1.0
    yield
    remove_orphaned_shm_regions(changed_since=started)


def _kernel_log() -> list[str] | None:
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


@pytest.fixture(scope="session", autouse=True)
def no_stub_crashed() -> Iterator[None]:
    """No Python-backend stub of a server this session started died of a signal the kernel logs
    (a segfault at exit, issue "Hardening" row 4). The stubs are noted every 0.5 s while the
    session runs; the kernel log is read at the end (skipped where dmesg is not readable)."""
    before = _kernel_log()
    stub_pids: set[int] = set()
    done = threading.Event()

    def note_stubs() -> None:
        me = psutil.Process(os.getpid())
        while not done.wait(0.5):
            try:
                children = me.children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                try:
                    if child.name().startswith("triton_python_b"):
                        stub_pids.add(child.pid)
                except psutil.Error:
                    pass

    watcher = threading.Thread(target=note_stubs, name="stub-crash-watch", daemon=True)
    watcher.start()
    yield
    done.set()
    watcher.join(timeout=5)
    after = _kernel_log()
    if before is None or after is None:
        return
    new_lines = after[len(before) :] if after[: len(before)] == before else after
    crashes = [
        line
        for line in new_lines
        if (match := re.search(r"triton_python_b\[(\d+)\]", line)) and int(match.group(1)) in stub_pids
    ]
    assert not crashes, "stubs of this session's servers crashed:\n" + "\n".join(crashes)
