"""Where a shared engine core is reached: a private directory, and in it per share name a lock, the
listening socket and a secret.

    <runtime dir>/paged_llm-<uid>/        mode 0700, owned by us (a pre-created one is refused)
        <key>.lock    held (flock) by the core process for as long as it lives: whoever takes it
                      starts the core, the others attach
        <key>.sock    the core's listening Unix socket
        <key>.key     SECRET_BYTES random bytes, mode 0600, that an attaching stub sends first

`<key>` is a digest of the share name (a Unix socket path has at most 107 bytes). The runtime dir is
`$PAGED_LLM_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR`, else the temporary directory. A filesystem socket
and not an abstract one: an abstract name has no permissions (any local user can connect to it, or
bind it first), a socket in a 0700 directory can be reached by our own uid only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

SECRET_BYTES = 32
_MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with the terminating NUL


class ShareFilesError(RuntimeError):
    """The private directory or a file in it is not what it must be (owner, mode, type)."""


def runtime_dir() -> Path:
    """The first of $PAGED_LLM_RUNTIME_DIR, $XDG_RUNTIME_DIR that is a safe parent (a root's shell
    may have inherited a user's XDG_RUNTIME_DIR), else the temporary directory."""
    for variable in ("PAGED_LLM_RUNTIME_DIR", "XDG_RUNTIME_DIR"):
        configured = os.environ.get(variable)
        if configured and safe_parent_refusal(Path(configured)) is None:
            return Path(configured)
    return Path(tempfile.gettempdir())


def safe_parent_refusal(path: Path) -> str | None:
    """Why `path` cannot hold our private directory, or None: whoever may rename entries in it (its
    owner; any user where it is writable by others and not sticky) could swap ours for theirs."""
    try:
        info = os.stat(path)
    except OSError as error:
        return f"{path}: {error.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid not in (0, os.geteuid()):
        return f"{path} belongs to uid {info.st_uid}"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"{path} is writable by other users and not sticky"
    return None


def private_dir(base: Path | None = None) -> Path:
    """`base/paged_llm-<uid>`, created 0700; refused unless it is a directory (not a link) of ours
    that nobody else can enter: someone who made it first could read and replace what is in it."""
    base = base or runtime_dir()
    refusal = safe_parent_refusal(base)
    if refusal is not None:
        raise ShareFilesError(f"cannot keep the shared engine core's socket there: {refusal}")
    path = base / f"paged_llm-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    check_private(path, stat.S_IFDIR)
    return path


def check_private(path: Path, kind: int) -> os.stat_result:
    """`path` (not followed if a link) is a `kind` (stat.S_IFDIR, S_IFREG, ...) owned by our uid
    that no other user can read or write."""
    info = os.lstat(path)
    if stat.S_IFMT(info.st_mode) != kind:
        raise ShareFilesError(f"{path} is not a {_KIND_NAMES.get(kind, 'file')} (or is a link): refused")
    if info.st_uid != os.geteuid():
        raise ShareFilesError(f"{path} belongs to uid {info.st_uid}, not to uid {os.geteuid()}: refused")
    if info.st_mode & 0o077:
        raise ShareFilesError(
            f"{path} has mode {stat.S_IMODE(info.st_mode):o}: other users can reach it (must be 700/600)"
        )
    return info


_KIND_NAMES = {stat.S_IFDIR: "directory", stat.S_IFREG: "regular file"}


@dataclass(frozen=True)
class ShareFiles:
    """The files of one share name in the private directory."""

    prefix: Path  # <private dir>/<key>

    @classmethod
    def for_name(cls, share_name: str, directory: Path | None = None) -> ShareFiles:
        key = hashlib.sha256(share_name.encode()).hexdigest()[:16]
        files = cls((directory or private_dir()) / key)
        if len(os.fsencode(files.socket)) > _MAX_SOCKET_PATH_BYTES:
            raise ShareFilesError(
                f"the shared engine core's socket path {files.socket} is longer than "
                f"{_MAX_SOCKET_PATH_BYTES} bytes: set PAGED_LLM_RUNTIME_DIR to a shorter directory"
            )
        return files

    @property
    def lock(self) -> Path:
        return self.prefix.with_suffix(".lock")

    @property
    def socket(self) -> Path:
        return self.prefix.with_suffix(".sock")

    @property
    def secret(self) -> Path:
        return self.prefix.with_suffix(".key")

    # ------------------------------------------------------------------------------- owner
    def try_lock(self) -> int | None:
        """An fd holding the share's lock, or None if another process holds it (a core runs or is
        starting). The lock goes when every copy of the fd is closed (the core's, at its exit)."""
        while True:
            fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            # The holder before us may have removed the file while we waited for it (`remove`):
            # our lock is then on a file nobody else opens. Retry on the one the path names now.
            try:
                current = os.lstat(self.lock)
            except FileNotFoundError:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            return fd

    def write_secret(self) -> None:
        """A fresh secret, replacing any old one at once (an attacher never reads half of one)."""
        temporary = self.prefix.with_suffix(f".key.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
        finally:
            os.close(fd)
        os.replace(temporary, self.secret)

    def remove(self) -> None:
        """The socket, secret and lock files; only while holding the lock (see try_lock)."""
        for path in (self.socket, self.secret, self.lock):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # ---------------------------------------------------------------------- both sides
    def read_secret(self) -> bytes:
        """The share's secret: a 0600 regular file of ours of exactly SECRET_BYTES bytes."""
        fd = os.open(self.secret, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise ShareFilesError(f"{self.secret} is not a private file of ours: refused")
            secret = os.read(fd, SECRET_BYTES + 1)
        finally:
            os.close(fd)
        if len(secret) != SECRET_BYTES:
            raise ShareFilesError(f"{self.secret} does not hold a secret of {SECRET_BYTES} bytes")
        return secret


def remove_if_unused(files: ShareFiles) -> None:
    """The share's files, if no process holds its lock (its core is gone, none started since)."""
    try:
        fd = files.try_lock()
    except OSError:
        return
    if fd is not None:
        try:
            files.remove()
        finally:
            os.close(fd)


def remove_stale_shares(directory: Path) -> None:
    """Files of shares whose core is gone without removing them (killed): their lock is free."""
    for lock in directory.glob("*.lock"):
        remove_if_unused(ShareFiles(lock.with_suffix("")))
