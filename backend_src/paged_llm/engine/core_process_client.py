"""The engine core in a process of its own, seen from the stub: start it (or join the one
another Triton instance of the model started), then talk to it over a socket.

`ProcessCoreClient` starts `python -m paged_llm.engine.engine_core.process` and owns it;
`AttachedCoreClient` joins a core that another instance owns (engine/engine_core/stub_links.py);
`connect_engine_core` decides which, by the share's lock in a private directory
(engine/share_files.py); an attached stub proves it holds the share's secret before anything
is pickled (engine/attach_gate.py). Both speak the same framed-pickle link (engine/ipc.py) through
`_LinkedCoreClient`.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from paged_llm.config import ConfigError, EngineConfig
from paged_llm.engine.attach_gate import ACK, hello, peer_credentials, recv_exactly
from paged_llm.engine.core_types import (
    AbortRequest,
    AttachStub,
    CoreStartupFailed,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StubAttached,
    UtilityCall,
)
from paged_llm.engine.ipc import FramedSocket
from paged_llm.engine.share_files import ShareFiles, ShareFilesError, remove_if_unused, remove_stale_shares
from paged_llm.errors import EngineDeadError
from paged_llm.processes import python_executable, spawn_module

logger = logging.getLogger(__name__)
CORE_PROCESS_MODULE = "paged_llm.engine.engine_core.process"  # what the core process runs (`python -m`)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class _LinkedCoreClient:
    """A core at the other end of a FramedSocket: the one this process started, or a shared one."""

    request_id_prefix = ""  # the core routes outputs back to its stubs by this (stub_links.py)
    owns_core = True

    def __init__(self, link: FramedSocket) -> None:
        self._link = link
        self._call_ids = itertools.count()
        self._exited = threading.Event()  # the core (or our link to it) is gone
        self.death_reason: str | None = None

    def _reason(self) -> str:
        return self.death_reason or "the engine core process closed its connection"

    def _link_lost(self) -> None:
        """The link failed: give whoever records why a moment to do so."""
        self._exited.wait(timeout=2.0)

    def _send(self, message: object) -> None:
        if self._exited.is_set():
            raise EngineDeadError(self._reason())
        try:
            self._link.send(message)
        except OSError as error:
            self._link_lost()
            raise EngineDeadError(f"{self._reason()} ({error})") from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, aborts: list[AbortRequest]) -> None:
        for abort in aborts:
            self._send(abort)

    def send_utility(self, name: str, *args: Any) -> int:
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, name, args))
        return call_id

    def get_outputs(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        try:
            return self._link.recv(timeout_s)
        except (EOFError, OSError):
            self._link_lost()
            raise EngineDeadError(self._reason()) from None

    def poll_outputs(self) -> EngineCoreOutputs | None:
        if not self._link.poll():
            return None
        return self.get_outputs(0.0)


@dataclass(frozen=True)
class CoreShare:
    """What a core that others share is handed: its listening socket, the share's lock (the core
    holds it while it lives) and the share's files (engine/share_files.py)."""

    listener: socket.socket
    lock_fd: int
    files: ShareFiles


class ProcessCoreClient(_LinkedCoreClient):
    """The core in its own process, over a socketpair (engine/ipc.py).

    A supervisor thread starts the process and waits for it, so a death is noticed at once (and
    logged with its exit status); it also closes our end of the link, which wakes the reader.
    `share`: the core listens there for other stubs (connect_engine_core).
    """

    STARTUP_POLL_S = 0.5

    def __init__(
        self, config: EngineConfig, watch_pid: int | None = None, share: CoreShare | None = None
    ) -> None:
        self._watch_pid = watch_pid
        self._share = share
        self._python = config.serving.engine_python or python_executable()
        ours, theirs = socket.socketpair()
        super().__init__(FramedSocket(ours))
        self._theirs = theirs
        self._started = threading.Event()
        self.process: subprocess.Popen | None = None
        self._start_error: BaseException | None = None
        self._supervisor = threading.Thread(
            target=self._supervise, name="paged_llm-core-supervisor", daemon=True
        )
        self._supervisor.start()
        self._started.wait()
        theirs.close()
        if self._start_error is not None:
            raise RuntimeError(f"could not start the engine core process: {self._start_error}")
        self.info = self._handshake(config)

    def _supervise(self) -> None:
        """Starts the core process and waits for it. The process's parent-death signal is tied to
        this thread, which lives exactly as long as the process."""
        args = [
            "--fd",
            str(self._theirs.fileno()),
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            logging.getLevelName(logging.getLogger("paged_llm").getEffectiveLevel()),
        ]
        pass_fds = [self._theirs.fileno()]
        if self._watch_pid is not None:
            args += ["--watch-pid", str(self._watch_pid)]
        if self._share is not None:
            listen_fd, lock_fd = self._share.listener.fileno(), self._share.lock_fd
            args += ["--listen-fd", str(listen_fd), "--lock-fd", str(lock_fd)]
            args += ["--share-files", str(self._share.files.prefix)]
            pass_fds += [listen_fd, lock_fd]
        try:
            self.process = spawn_module(
                CORE_PROCESS_MODULE, args, python=self._python, pass_fds=pass_fds, close_fds=True
            )
        except OSError as error:
            self._start_error = error
            self._started.set()
            return
        self._started.set()
        returncode = self.process.wait()
        # The pid goes to the log only: clients get this reason, and internals are not theirs.
        self.death_reason = f"the engine core process {describe_exit(returncode)}"
        if returncode != 0:
            logger.error("the engine core process (pid %d) %s", self.process.pid, describe_exit(returncode))
        if self._share is not None:  # a killed core could not remove them itself
            remove_if_unused(self._share.files)
        self._exited.set()
        try:
            self._link.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked on the link
        except OSError:
            pass

    def _handshake(self, config: EngineConfig) -> EngineCoreInfo:
        self._send(config)
        while True:  # loading a large model takes minutes: wait as long as the process lives
            try:
                reply = self._link.recv(self.STARTUP_POLL_S)
            except (EOFError, OSError):
                self._exited.wait(timeout=5.0)
                raise RuntimeError(f"{self._reason()} before it was ready (see the log above)") from None
            if reply is None:
                continue
            if isinstance(reply, CoreStartupFailed):
                self.shutdown()
                if reply.is_config_error:
                    raise ConfigError(reply.message)
                raise RuntimeError(f"the engine core failed to start: {reply.message}")
            return reply

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Asks the core to stop, waits up to `timeout_s`, then kills it. Idempotent."""
        if self.process is None or self._exited.is_set():
            self._link.close()
            return
        try:
            self._link.send(Shutdown("the engine is shutting down"))
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        while not self._exited.wait(timeout=0.05):
            # Keep reading so the core never blocks on a full socket while it says goodbye.
            try:
                self._link.recv(0.0)
            except (EOFError, OSError):
                pass
            if time.monotonic() >= deadline:
                logger.warning("the engine core did not stop within %.1f s: killing it", timeout_s)
                self.process.kill()
                self._exited.wait(timeout=5.0)
                break
        self._link.close()


class AttachRefused(ConnectionError):
    """The shared core closed the connection before it let us in: it refused us (see its log), or
    it is going away. connect_engine_core retries."""


class AttachedCoreClient(_LinkedCoreClient):
    """A core that another stub (another Triton instance of this model) started, reached
    through its listening socket. Its requests carry our prefix; shutdown() only detaches."""

    owns_core = False
    STARTUP_POLL_S = 0.5
    ACK_TIMEOUT_S = 120.0  # the core's gate starts with its process, before the model loads

    def __init__(self, files: ShareFiles) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # FileNotFoundError / ConnectionRefusedError: nobody listens (yet, or any more)
            sock.connect(str(files.socket))
            listener_uid = peer_credentials(sock).uid
            if listener_uid != os.geteuid():  # the directory is ours: only a bug gets here
                raise ShareFilesError(f"{files.socket} is served by uid {listener_uid}: refused")
            sock.sendall(hello(files.read_secret()))
            if recv_exactly(sock, len(ACK), self.ACK_TIMEOUT_S) != ACK:
                raise AttachRefused("the shared engine core closed the connection before letting us in")
        except BaseException:
            sock.close()
            raise
        super().__init__(FramedSocket(sock))
        self.pid: int | None = None
        self._send(AttachStub(os.getpid()))
        while True:  # the core answers once its model is loaded: wait as long as the link lives
            try:
                reply = self._link.recv(self.STARTUP_POLL_S)
            except (EOFError, OSError):
                self._link.close()
                raise RuntimeError(
                    "the engine core started by another instance of this model stopped before it was "
                    "ready (see that instance's log)"
                ) from None
            if reply is not None:
                break
        if not isinstance(reply, StubAttached):
            self._link.close()
            raise RuntimeError(f"unexpected answer from the shared engine core: {type(reply).__name__}")
        self.info = reply.info
        self.stub_id = reply.stub_id
        self.request_id_prefix = reply.request_id_prefix

    def _reason(self) -> str:
        return self.death_reason or (
            "the shared engine core closed its connection (the instance that started it stopped, "
            "or the core died)"
        )

    def _link_lost(self) -> None:
        self._exited.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Detaches: the core aborts what is left of ours and closes the link. Idempotent."""
        if not self._exited.is_set():
            try:
                self._link.send(Shutdown("the stub detached"))
                deadline = time.monotonic() + min(timeout_s, 2.0)
                while time.monotonic() < deadline:  # read until the core closes its side
                    self._link.recv(0.05)
            except (EOFError, OSError):
                pass
            self._exited.set()
        self._link.close()


ATTACH_RETRY_S = 30.0  # how long an instance keeps trying to join a shared core that is starting


def connect_engine_core(
    config: EngineConfig, watch_pid: int | None = None, share_name: str | None = None
) -> ProcessCoreClient | AttachedCoreClient:
    """The engine core in its own process. With `share_name`, every caller that passes the same name
    shares one core: the first one to take the share's lock starts the core (which listens on the
    share's socket and holds the lock while it lives), the others attach to it
    (engine/engine_core/stub_links.py)."""
    if share_name is None:
        return ProcessCoreClient(config, watch_pid)
    files = ShareFiles.for_name(share_name)
    deadline = time.monotonic() + ATTACH_RETRY_S
    while True:
        lock_fd = files.try_lock()
        if lock_fd is not None:
            try:
                return _start_shared_core(config, watch_pid, files, lock_fd)
            except BaseException:
                os.close(lock_fd)
                remove_if_unused(files)  # the core did not start: nothing of it may stay
                raise
        try:
            client = AttachedCoreClient(files)
        except (FileNotFoundError, ConnectionError) as error:  # starting, or just gone: retry
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"could not start or join the shared engine core {share_name!r}: {error}"
                ) from None
            time.sleep(0.05)
            continue
        logger.info("attached to the shared engine core %r as stub %d", share_name, client.stub_id)
        return client


def _start_shared_core(
    config: EngineConfig, watch_pid: int | None, files: ShareFiles, lock_fd: int
) -> ProcessCoreClient:
    listener = _listen(files)
    try:
        remove_stale_shares(files.prefix.parent)
        client = ProcessCoreClient(config, watch_pid, CoreShare(listener, lock_fd, files))
    finally:
        listener.close()  # the core process holds its own copy
    os.close(lock_fd)  # and of this one: the share's lock now lives as long as the core
    return client


def _listen(files: ShareFiles) -> socket.socket:
    """The share's listening socket, with a fresh secret; what a killed core left there goes."""
    files.write_secret()
    try:
        files.socket.unlink()
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(files.socket))
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    return listener
