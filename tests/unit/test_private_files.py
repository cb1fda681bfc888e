"""launcher/private_files.py: the wrapper tritonserver runs under (umask 077, and fchmod(fd, 0644) kept
from widening a file, as boost::interprocess does to the Python backend's shared memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from paged_llm.launcher import private_files
from paged_llm.launcher.launch import ServerPorts, server_command

# What boost::interprocess does to a new region (strace of Triton 2.51), then two calls that must
# keep working: a fchmod to another mode and a chmod by path.
_PROBE = """
import os, sys
region, script = sys.argv[1], sys.argv[2]
fd = os.open(region, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o644)
os.fchmod(fd, 0o644)
print(oct(os.stat(region).st_mode & 0o777))
fd = os.open(script, os.O_CREAT | os.O_RDWR, 0o600)
os.fchmod(fd, 0o755)
print(oct(os.stat(script).st_mode & 0o777))
os.chmod(region, 0o640)
print(oct(os.stat(region).st_mode & 0o777))
"""


def _probe(tmp_path: Path, prefix: list[str]) -> list[str]:
    command = [*prefix, sys.executable, "-c", _PROBE, str(tmp_path / "region"), str(tmp_path / "script")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr == ""
    return done.stdout.split()


def test_a_file_fchmodded_to_0644_stays_0600_and_other_mode_changes_still_work(tmp_path):
    assert _probe(tmp_path, private_files.command_prefix()) == ["0o600", "0o755", "0o640"]


def test_without_the_wrapper_the_same_calls_leave_the_file_world_readable(tmp_path):
    assert _probe(tmp_path, [])[0] == "0o644"  # what the regions were before (and the probe is right)


def test_tritonserver_runs_under_the_wrapper():
    command = server_command(Path("/models"), ServerPorts())
    assert command[: len(private_files.command_prefix())] == private_files.command_prefix()
    assert command[len(private_files.command_prefix())].endswith("/bin/tritonserver")


def test_the_filter_is_built_for_known_machines_only():
    assert len(private_files.fchmod_filter("x86_64") or b"") == 9 * 8
    assert private_files.fchmod_filter("aarch64") != private_files.fchmod_filter("x86_64")
    assert private_files.fchmod_filter("riscv64") is None
