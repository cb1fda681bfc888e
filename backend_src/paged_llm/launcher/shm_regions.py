"""The Python backend's shared-memory regions in /dev/shm (one per stub, named on its command line):
which are still in use, and removing the ones that no process uses any more.

Triton removes a stub's region when it finalizes the model instance. It cannot when it is killed,
and it does not when it exits with a model it never finished unloading (Triton 2.51 keeps the
request of a gRPC stream cancelled after its final: README, Known limits): those regions stay in
/dev/shm until someone removes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from paged_llm.launcher.procfs import descendants

SHM_DIR = Path("/dev/shm")
SHM_REGION_GLOB = "triton_python_backend_shm_region_*"


def _shm_paths_in_use() -> set[str]:
    """/dev/shm paths some process has open or mapped (processes we may not inspect are skipped)."""
    in_use: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text(errors="replace").splitlines():
                if str(SHM_DIR) in line:
                    in_use.add(line.split(maxsplit=5)[-1].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(str(SHM_DIR)):
                    in_use.add(target)
        except OSError:
            continue
    return in_use


def remove_orphaned_shm_regions(changed_since: float) -> list[Path]:
    """Removes the Python backend's shared-memory regions that changed since `changed_since` (a
    time.time()) and that no process has open or mapped any more: what servers killed with SIGKILL
    leave behind (a server that stops normally removes its own). Returns what it removed."""
    in_use = _shm_paths_in_use()
    removed = []
    for path in SHM_DIR.glob(SHM_REGION_GLOB):
        try:
            if path.stat().st_mtime >= changed_since and str(path) not in in_use:
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    return removed


def stub_regions(server_pid: int) -> set[str]:
    """The region names on the command lines of the stubs below `server_pid` now."""
    names: set[str] = set()
    for pid in descendants(server_pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        names.update(a.decode() for a in args if a.startswith(b"triton_python_backend_shm_region_"))
    return names


def remove_unused_regions(names: Iterable[str], timeout_s: float = 10.0) -> list[Path]:
    """Removes these regions as soon as no process uses them (a stub may outlive its server by a
    few seconds), waiting up to `timeout_s`; regions already gone are skipped. Returns what it
    removed."""
    waiting = {SHM_DIR / name for name in names}
    removed: list[Path] = []
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = {path for path in waiting if path.exists()}
        in_use = _shm_paths_in_use() if waiting else set()
        for path in [p for p in waiting if str(p) not in in_use]:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
            waiting.discard(path)
        if not waiting or time.monotonic() >= deadline:
            return removed
        time.sleep(0.2)
