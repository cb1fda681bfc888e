"""Runs a command (tritonserver) so that the files its processes create are readable by their user
alone: `python private_files.py COMMAND...` sets the umask to 077 and execs COMMAND.

The umask alone does not reach the Python backend's shared-memory regions
(/dev/shm/triton_python_backend_shm_region_*, which hold every request's inputs and parameters,
the forwarded `authorization` header included): Triton creates them through boost::interprocess,
which opens them with mode 0644 and then calls fchmod(fd, 0644) so that the umask cannot narrow
them (seen with strace on Triton 2.51). So a seccomp filter is installed as well, inherited by every
process below the server (stubs, engine cores): fchmod with mode exactly 0644 succeeds without
changing anything, and the file keeps the 0600 its creation under umask 077 gave it. No other call
is touched (a fchmod to 0755 or 0600, chmod by path). The region is never world-readable, so no
other user can open it before a request arrives.

Stdlib only, and run with `python -I -S`: it starts in milliseconds and needs no package on the path.
Where the filter cannot be installed (not Linux on x86_64 / aarch64, a kernel without seccomp) it
says so on stderr and runs the command with the umask alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

PRIVATE_UMASK = 0o077
_KEPT_MODE = 0o644  # what boost::interprocess fchmods a new region to (its default permissions)

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000  # | 0: the call returns 0 without running
# seccomp_data: int nr, u32 arch, u64 instruction_pointer, u64 args[6] (little-endian hosts only)
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG1_LOW = 0, 4, 24
# machine -> (AUDIT_ARCH_*, the fchmod syscall number)
_FCHMOD = {"x86_64": (0xC000003E, 91), "aarch64": (0xC00000B7, 52)}

_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_AND_K, _BPF_RET_K = 0x20, 0x15, 0x54, 0x06


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _instruction(code: int, jump_true: int, jump_false: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def fchmod_filter(machine: str) -> bytes | None:
    """The BPF program (struct sock_filter[]) that makes fchmod(fd, 0644) a no-op, or None where
    the syscall numbers of `machine` are not known here."""
    if machine not in _FCHMOD:
        return None
    arch, fchmod_nr = _FCHMOD[machine]
    program = [
        _instruction(_BPF_LD_W_ABS, 0, 0, _OFFSET_ARCH),
        _instruction(_BPF_JEQ_K, 0, 5, arch),  # another ABI (i386 on x86_64): allow
        _instruction(_BPF_LD_W_ABS, 0, 0, _OFFSET_NR),
        _instruction(_BPF_JEQ_K, 0, 3, fchmod_nr),
        _instruction(_BPF_LD_W_ABS, 0, 0, _OFFSET_ARG1_LOW),
        _instruction(_BPF_AND_K, 0, 0, 0o7777),
        _instruction(_BPF_JEQ_K, 1, 0, _KEPT_MODE),
        _instruction(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
        _instruction(_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | 0),
    ]
    return b"".join(program)


def install_fchmod_filter() -> str | None:
    """Installs the filter on this process (and all it execs or forks later); why not, or None."""
    program = fchmod_filter(platform.machine())
    if program is None or sys.byteorder != "little":
        return f"no seccomp filter for {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}"
    return None


def command_prefix() -> list[str]:
    """What goes before a command to run it this way."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__)]


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: private_files.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    os.umask(PRIVATE_UMASK)
    problem = install_fchmod_filter()
    if problem is not None:
        print(
            f"paged_llm: {problem}: the Python backend's shared memory in /dev/shm stays "
            "readable by every local user (mode 0644)",
            file=sys.stderr,
            flush=True,
        )
    try:
        os.execv(argv[0], argv)
    except OSError as error:
        print(f"paged_llm: cannot run {argv[0]}: {error.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
