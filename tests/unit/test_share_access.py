"""Who may reach a shared engine core: the peer check on fake credentials (engine/attach_gate.py) and
the private directory, lock and secret (engine/share_files.py)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from paged_llm.engine.attach_gate import PeerCredentials, parent_pid_of, peer_refusal
from paged_llm.engine.share_files import (
    SECRET_BYTES,
    ShareFiles,
    ShareFilesError,
    private_dir,
    remove_stale_shares,
    runtime_dir,
)

OWNER_PID, SERVER_PID, UID = 100, 50, 1000
PARENTS = {101: SERVER_PID, 102: 1, OWNER_PID: SERVER_PID}


def refusal(pid: int, uid: int = UID, server_pid: int | None = SERVER_PID) -> str | None:
    return peer_refusal(PeerCredentials(pid, uid, uid), UID, OWNER_PID, server_pid, PARENTS.get)


def test_a_peer_of_another_uid_is_refused_even_a_stub_of_the_same_server():
    assert "uid 65534" in refusal(101, uid=65534)
    assert "uid 0" in refusal(OWNER_PID, uid=0)


def test_a_same_uid_peer_must_be_the_owner_or_a_child_of_the_server():
    assert refusal(OWNER_PID) is None
    assert refusal(101) is None  # another stub of the same server
    assert "not the server process 50" in refusal(102)
    assert "not visible" in refusal(0)
    assert refusal(OWNER_PID, server_pid=None) is None
    assert "not the process 100" in refusal(101, server_pid=None)  # no server known: the owner only


@pytest.fixture
def short_tmp():
    """A Unix socket path has at most 107 bytes: pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="pl-"))
    yield path
    shutil.rmtree(path)


def test_parent_pid_of_reads_proc():
    assert parent_pid_of(os.getpid()) == os.getppid()
    assert parent_pid_of(-1) is None


def test_private_dir_is_created_0700_and_reused(tmp_path):
    made = private_dir(tmp_path)
    assert made == tmp_path / f"paged_llm-{os.geteuid()}"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert private_dir(tmp_path) == made


@pytest.mark.parametrize("mode", [0o755, 0o711, 0o770, 0o701])
def test_a_pre_created_dir_that_others_can_enter_is_refused(tmp_path, mode):
    path = tmp_path / f"paged_llm-{os.geteuid()}"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(ShareFilesError, match="other users can reach it"):
        private_dir(tmp_path)


def test_a_link_or_a_file_in_place_of_the_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / f"paged_llm-{os.geteuid()}").symlink_to(target)
    with pytest.raises(ShareFilesError, match="is a link"):
        private_dir(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / f"paged_llm-{os.geteuid()}").write_bytes(b"")
    with pytest.raises(ShareFilesError, match="not a directory"):
        private_dir(other)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_dir_pre_created_by_another_uid_is_refused(tmp_path):
    path = tmp_path / f"paged_llm-{os.geteuid()}"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(ShareFilesError, match="belongs to uid 65534"):
        private_dir(tmp_path)


def test_the_lock_is_exclusive_and_freed_with_its_fd(short_tmp):
    files = ShareFiles.for_name("1234/llm/1/0", private_dir(short_tmp))
    first = files.try_lock()
    assert first is not None
    assert files.try_lock() is None
    os.close(first)
    again = files.try_lock()
    assert again is not None
    os.close(again)


def test_the_secret_is_private_fixed_size_and_fresh(short_tmp):
    files = ShareFiles.for_name("1234/llm/1/0", private_dir(short_tmp))
    files.write_secret()
    assert stat.S_IMODE(files.secret.stat().st_mode) == 0o600
    first = files.read_secret()
    assert len(first) == SECRET_BYTES
    files.write_secret()
    assert files.read_secret() != first
    files.secret.chmod(0o644)
    with pytest.raises(ShareFilesError, match="not a private file"):
        files.read_secret()
    files.secret.chmod(0o600)
    files.secret.write_bytes(b"short")
    with pytest.raises(ShareFilesError, match="does not hold a secret"):
        files.read_secret()


def test_stale_shares_go_and_held_ones_stay(short_tmp):
    directory = private_dir(short_tmp)
    held, stale = ShareFiles.for_name("1/llm/1/0", directory), ShareFiles.for_name("2/llm/1/0", directory)
    fds = []
    for files in (held, stale):
        fds.append(files.try_lock())
        files.write_secret()
        files.socket.write_bytes(b"")
    os.close(fds[1])  # the core of `stale` was killed
    remove_stale_shares(directory)
    assert held.lock.exists() and held.secret.exists() and held.socket.exists()
    assert not stale.lock.exists() and not stale.secret.exists() and not stale.socket.exists()
    os.close(fds[0])


def test_a_long_runtime_dir_is_refused_with_a_hint(tmp_path):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(ShareFilesError, match="PAGED_LLM_RUNTIME_DIR"):
        ShareFiles.for_name("1234/llm/1/0", private_dir(deep))


def test_a_parent_that_others_could_rename_in_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ShareFilesError, match="writable by other users and not sticky"):
        private_dir(shared)
    shared.chmod(0o1777)  # like /tmp
    assert private_dir(shared).parent == shared


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_another_users_runtime_dir_is_not_used(tmp_path, monkeypatch):
    theirs = tmp_path / "run-user-65534"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    monkeypatch.delenv("PAGED_LLM_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(theirs))
    assert runtime_dir() == Path(tempfile.gettempdir())
    monkeypatch.setenv("PAGED_LLM_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == tmp_path
