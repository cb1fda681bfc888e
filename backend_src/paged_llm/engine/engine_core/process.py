"""The engine core process: `python -m paged_llm.engine.engine_core.process --fd FD --parent-pid PID`.

Started by ProcessCoreClient (engine/core_process_client.py) with one end of a socketpair as FD. It
reads the EngineConfig, builds the EngineCore (the only place CUDA is initialised), answers with
EngineCoreInfo (or CoreStartupFailed) and runs the busy loop, which never waits on the socket:

    stub ──frames──> reader thread ──inbox──> busy loop ──frames──> stub
                                                       └─(socket full)─> writer thread ──┘

The loop sends each step's outputs itself, without blocking (a thread handing frames over would
contend with it for the GIL every step); only what does not fit in the socket buffer, because the
stub is behind, goes to the writer thread, and later frames queue behind it in order. With
`--listen-fd` (and `--share-files`, `--lock-fd`: engine/share_files.py), further stubs (other
Triton instances of the model) attach on that socket and share the core (engine/engine_core/stub_links.py),
once its gate let them in (engine/attach_gate.py); the core holds the share's lock while it lives
and removes the share's files when it exits.

It never outlives its parent: the kernel sends it SIGKILL when the parent dies (PR_SET_PDEATHSIG),
a watchdog thread also compares getppid(), and EOF on the socket (the parent closed it or died)
shuts the loop down, with a hard exit if that does not finish within EXIT_GRACE_S. Under Triton
the watchdog also follows the server process itself (`--watch-pid`): a stub that hangs after its
server died must not keep the device memory held. SIGINT is
ignored: Ctrl-C reaches the whole process group, and the stub decides how to stop.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from paged_llm.config import ConfigError
from paged_llm.engine.attach_gate import AttachGate
from paged_llm.engine.core_types import CoreInput, CoreStartupFailed, Shutdown
from paged_llm.engine.engine_core.step_loop import run_busy_loop
from paged_llm.engine.engine_core.stub_links import StubLinks
from paged_llm.engine.ipc import FramedSocket
from paged_llm.engine.share_files import ShareFiles
from paged_llm.processes import parent_death_signal, watch_parent

logger = logging.getLogger("paged_llm.core")
EXIT_GRACE_S = 5.0  # after the stub is gone, the loop gets this long to stop before a hard exit
_share_files: ShareFiles | None = None  # removed on every exit that runs code (not on SIGKILL)


def _exit(code: int) -> None:
    if _share_files is not None:
        try:
            _share_files.remove()  # while this process still holds the share's lock
        except OSError:
            pass
    os._exit(code)


def _die_with_parent(parent_pid: int, watch_pid: int | None) -> None:
    set_signal = parent_death_signal(signal.SIGKILL)
    if set_signal is not None:  # elsewhere than Linux the watchdog thread below still notices
        set_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        _exit(1)

    def parent_gone() -> None:
        logger.error("the stub process %d is gone: exiting", parent_pid)
        _exit(1)

    def server_gone() -> None:
        # The stub that started this core goes too: it notices the server's death by itself,
        # but not while a Triton call it is blocked in holds its GIL (seen: a stub in
        # initialize() outlived a server stopped with SIGTERM by more than 10 s).
        logger.error("the server process %d is gone: exiting, and ending stub %d", watch_pid, parent_pid)
        try:
            os.kill(parent_pid, signal.SIGKILL)
        except OSError:
            pass
        _exit(1)

    watch_parent(parent_pid, parent_gone, "paged_llm-core-watchdog", watch_pid, server_gone)


def _exit_on_worker_death(message: str) -> None:
    logger.error("%s: the engine core exits", message)
    sys.stderr.flush()
    _exit(1)


def _hard_exit_later(delay_s: float, code: int) -> None:
    timer = threading.Timer(delay_s, lambda: _exit(code))
    timer.daemon = True
    timer.start()


def _read_inputs(link: FramedSocket, inbox: queue.SimpleQueue[CoreInput]) -> None:
    try:
        while True:
            inbox.put(link.recv())
    except (EOFError, OSError) as error:
        inbox.put(Shutdown(f"the stub closed the connection ({error})"))
        _hard_exit_later(EXIT_GRACE_S, 1)


def serve(link: FramedSocket, gate: AttachGate | None = None) -> int:
    """`gate`: further stubs that it let in attach once the core is ready
    (engine/engine_core/stub_links.py)."""
    from paged_llm.engine.engine_core.core import EngineCore  # imports torch: after the parent watch is up

    config = link.recv()
    try:
        core = EngineCore(config, show_progress=False)
    except BaseException as error:
        logger.error("engine core failed to start:\n%s", "".join(traceback.format_exception(error)))
        message = f"{type(error).__name__}: {error}" if not isinstance(error, ConfigError) else str(error)
        link.send(CoreStartupFailed(message, isinstance(error, ConfigError)))
        return 1
    link.send(core.info)
    # A dead tensor-parallel worker can leave the loop blocked in a device wait for ever: the
    # process ends instead, and the stub reports the core dead to every request.
    core.runner.watch_workers(_exit_on_worker_death)
    # The model, its CUDA graphs and buffers live as long as the process: keep them out of every
    # later garbage collection, which then scans only what the steps create (shorter loop pauses).
    gc.freeze()
    inbox: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
    threading.Thread(target=_read_inputs, args=(link, inbox), name="paged_llm-core-in", daemon=True).start()
    stub_links = StubLinks(link, inbox, core.info)
    if gate is not None:
        stub_links.accept_from(gate)
    try:
        reason = run_busy_loop(core, inbox, stub_links.publish)
    except BaseException as error:
        logger.error("engine core crashed:\n%s", "".join(traceback.format_exception(error)))
        return 1
    finally:
        core.close()
    stub_links.close(timeout_s=EXIT_GRACE_S)
    logger.info("engine core stopped: %s", reason)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m paged_llm.engine.engine_core.process")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket to the stub")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--watch-pid", type=int, default=None, help="also exit when this process is gone")
    parser.add_argument("--listen-fd", type=int, default=None, help="listening socket: stubs attach")
    parser.add_argument("--lock-fd", type=int, default=None, help="the share's lock: held while we live")
    parser.add_argument("--share-files", default=None, help="the share's files (engine/share_files.py)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    global _share_files
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"paged_llm core [{os.getpid()}] %(levelname)s: %(message)s"))
    package_logger = logging.getLogger("paged_llm")
    package_logger.addHandler(handler)
    package_logger.setLevel(args.log_level)
    _die_with_parent(args.parent_pid, args.watch_pid)
    link = FramedSocket(socket.socket(fileno=args.fd))
    listener = None if args.listen_fd is None else socket.socket(fileno=args.listen_fd)
    for fd in (link.sock.fileno(), args.listen_fd, args.lock_fd):  # for us only, not for our children
        if fd is not None:
            os.set_inheritable(fd, False)
    gate = None
    if listener is not None:
        if args.share_files is None:
            parser.error("--listen-fd needs --share-files")
        _share_files = ShareFiles(Path(args.share_files))
        # Started before the model loads: a peer is refused (or let in) at once, never decoded.
        gate = AttachGate(listener, _share_files.read_secret(), args.parent_pid, args.watch_pid)
        gate.start()
    code = serve(link, gate)
    sys.stderr.flush()
    # Skip interpreter teardown (joining IO threads, CUDA context destructors): the process owns
    # nothing that needs it, and the device memory is released when it exits.
    _exit(code)


if __name__ == "__main__":
    main()
