"""Notices, from inside the stub, that tritonserver has begun to shut down.

Triton 2.51 never tells a Python model that the server is stopping: on SIGINT / SIGTERM it closes its
HTTP and gRPC endpoints at once, then waits up to --exit-timeout-secs for the models to unload, and
a decoupled model with streams still open cannot unload (its response senders keep it alive), so
the server then "exits immediately" and hangs in its own teardown, with our processes left behind.
Watching the server's own listening port is the signal that is there: once it was open and is
refused, the server is going away, its clients are already cut off, and the model should end every
request in flight so that the unload (and finalize) can happen.

Even then, Triton 2.51 cannot unload a model while a client still holds a gRPC stream open (fixed in
later releases, server#7969): it waits --exit-timeout-secs, "exits immediately" and hangs in its
teardown. So after ending its requests the model also stops its engine core at once (the device
memory is free within a second) and, if Triton has not finalized it by the exit timeout, the stub
leaves on its own. `paged_llm.launcher.launch serve` kills a server that hangs after that.

If the server dies outright (SIGKILL), the stub's own exit path can hang for good: its cleanup waits
on messages that no longer have a receiver (seen with threads blocked in is_cancelled()).
`ServerDeathWatch` is the stub's own way out.

The port and the exit timeout come from tritonserver's command line (/proc/<pid>/cmdline):
--http-port / --http-address, or the gRPC ones when HTTP is off; Triton's defaults otherwise.
"""

from __future__ import annotations

import http.client
import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

_DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
DEFAULT_EXIT_TIMEOUT_S = 30.0  # tritonserver's --exit-timeout-secs default
_CONNECT_TIMEOUT_S = 0.2


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    exit_timeout_s: float = DEFAULT_EXIT_TIMEOUT_S  # how long the server waits for models at exit
    protocol: str = "http"  # "http", or "grpc" when the server has HTTP off


def _options(argv: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg.startswith("--"):
            name, has_value, value = arg[2:].partition("=")
            if not has_value and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                value = argv[index + 1]
                index += 1
            options[name] = value
        index += 1
    return options


def server_endpoint(argv: list[str]) -> Endpoint | None:
    """The endpoint a tritonserver started with `argv` listens on (HTTP, else gRPC), or None."""
    options = _options(argv)
    try:
        exit_timeout_s = float(options.get("exit-timeout-secs", DEFAULT_EXIT_TIMEOUT_S))
    except ValueError:
        exit_timeout_s = DEFAULT_EXIT_TIMEOUT_S
    for protocol in ("http", "grpc"):
        if options.get(f"allow-{protocol}", "true").lower() in ("false", "0", "no"):
            continue
        try:
            port = int(options.get(f"{protocol}-port", _DEFAULT_PORTS[protocol]))
        except ValueError:
            continue
        host = options.get(f"{protocol}-address", "0.0.0.0")
        return Endpoint(
            "127.0.0.1" if host in ("0.0.0.0", "", "::") else host, port, exit_timeout_s, protocol
        )
    return None


def endpoint_of_process(pid: int) -> Endpoint | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    if not argv or "tritonserver" not in Path(argv[0]).name:
        return None
    return server_endpoint(argv[1:])


class ServerShutdownWatch:
    """`shutting_down()` turns True (and stays) once the server, seen answering, stops: its port is
    refused, or (HTTP) it still accepts connections but resets them. Triton 2.51 keeps its HTTP port
    listening while it drains open HTTP connections for up to the exit timeout, resetting every new
    one (measured); a `generate_stream` client keeps its connection open until its request ends,
    so the model must notice then, or the whole exit timeout goes by and Triton exits without
    unloading it."""

    def __init__(self, endpoint: Endpoint | None) -> None:
        self.endpoint = endpoint
        self._seen_open = False
        self._closed = False

    def mark_open(self) -> None:
        """A request arrived, so the server's endpoints were open (the port may close before the
        first look at it)."""
        self._seen_open = True

    def shutting_down(self) -> bool:
        if self._closed or self.endpoint is None:
            return self._closed
        answer = self._probe(self.endpoint)
        if answer == "open":
            self._seen_open = True
        elif answer == "closed":
            self._closed = self._seen_open
        return self._closed

    @staticmethod
    def _probe(endpoint: Endpoint) -> str:
        """open, closed or unknown (a timeout or an unreachable address says nothing)."""
        if endpoint.protocol != "http":
            try:
                with socket.create_connection((endpoint.host, endpoint.port), _CONNECT_TIMEOUT_S):
                    return "open"
            except ConnectionRefusedError:
                return "closed"
            except OSError:
                return "unknown"
        connection = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=_CONNECT_TIMEOUT_S)
        try:
            connection.request("GET", "/v2/health/live")
            connection.getresponse().read()
            return "open"  # whatever the status: it answered
        except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
            return "closed"  # refused, or accepted and reset: draining (RemoteDisconnected is a reset)
        except (OSError, http.client.HTTPException):
            return "unknown"
        finally:
            connection.close()


class ModelUnloadWatch:
    """`unloading()` turns True (and stays) once the server, which said this model version was
    ready, says it no longer is: an unload has begun (`POST .../unload`, or a repository change
    under polling). Triton 2.51 tells a Python model nothing until finalize(), and it calls that
    only after every request in flight has sent its FINAL, so without this an unload waits for the
    longest stream to end. Asked over HTTP (`GET /v2/models/<name>/versions/<v>/ready`); a server
    without HTTP, or one that refuses the question (restricted API), leaves it False.
    """

    def __init__(
        self, endpoint: Endpoint | None, model_name: str, model_version: str, timeout_s: float = 5.0
    ) -> None:
        """`timeout_s`: a busy server can take seconds to answer; ask from a thread of its own."""
        self.endpoint = endpoint if endpoint is not None and endpoint.protocol == "http" else None
        self._timeout_s = timeout_s
        self._path = f"/v2/models/{quote(model_name, safe='')}/versions/{quote(model_version, safe='')}/ready"
        self._seen_ready = False
        self._unloading = False

    def mark_ready(self) -> None:
        """A request arrived, so Triton had the model READY (an unload may begin before the first
        look at it)."""
        self._seen_ready = True

    def unloading(self) -> bool:
        if self._unloading or self.endpoint is None:
            return self._unloading
        connection = http.client.HTTPConnection(
            self.endpoint.host, self.endpoint.port, timeout=self._timeout_s
        )
        try:
            connection.request("GET", self._path)
            status = connection.getresponse().status
        except (OSError, http.client.HTTPException):
            return False  # says nothing: the server's own shutdown is ServerShutdownWatch's business
        finally:
            connection.close()
        if status == 200:
            self._seen_ready = True
        elif status == 400:  # Triton's answer for a model that is not (or no longer) ready
            self._unloading = self._seen_ready
        return self._unloading


class ServerDeathWatch:
    """A thread that ends this process (exit status 1) once `server_pid` is no longer its parent.
    It calls nothing of Triton's: every pb_utils call may block once the server is gone.

    `stop()` ends it: finalize() does, last, so that no thread of ours is left running while the
    stub tears its interpreter down (a daemon thread that wakes during Py_Finalize is ended from
    inside its GIL wait, a known source of crashes at exit: cpython#84058). After finalize() the
    stub only reports to the server and exits; nothing of ours waits on the server any more. The
    trade-off: a server SIGKILLed in that last moment is left to the stub's own exit path, which
    the module docstring says can hang (not seen in that window)."""

    def __init__(self, server_pid: int, interval_s: float = 0.5) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(server_pid, interval_s), name="paged_llm-server-watch", daemon=True
        )
        self._thread.start()

    def _watch(self, server_pid: int, interval_s: float) -> None:
        while os.getppid() == server_pid:
            if self._stopped.wait(interval_s):
                return
        print("paged_llm: tritonserver is gone; the stub exits", file=sys.stderr, flush=True)
        os._exit(1)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._thread.join(timeout=timeout_s)
