"""The HTTP guard in front of tritonserver's HTTP and metrics ports.

tritonserver 2.51 (its evhtp HTTP layer) dies of SIGSEGV on one request: a body of about half its
threads' stack size (4.19 MB with the usual 8 MiB) sent as `application/x-www-form-urlencoded`, on
the HTTP port or the metrics port, on any route. The body is parsed before any handler runs, so
`--http-restricted-api` does not help, and Triton has no body-size option. So `paged-llm serve` and
`launch serve` bind Triton's HTTP and metrics endpoints to loopback ports of their own and put this
guard on the public ones. Per request, from its head (parsed with httptools) and before a byte of
it goes on:

* a `Content-Type` naming x-www-form-urlencoded (evhtp takes any value that starts so, in any
  case) is dropped: the request goes on without it, so evhtp does not parse the body as a form.
  Triton's routes read JSON or binary tensors whatever the type says, and `curl -d` (which sends
  that type) keeps working as before;
* `Content-Type` multipart/form-data: 415 (no KServe client sends it);
* a body over `max_body_bytes` (Content-Length): 413; a chunked one that grows over it: the
  connection is closed (what was forwarded of it is an incomplete request Triton drops);
* a head over MAX_HEAD_BYTES: 431; a method other than GET or POST (Triton serves no other): 405;
* Triton not listening (starting, restarting): 503 with Retry-After.

A refused request gets its answer after the responses to the requests before it on the connection,
then the connection is closed. Everything else is forwarded as it arrives (the head re-serialized,
a chunked body re-chunked) over one upstream connection per client connection, and the responses
come back byte for byte as Triton sends them (streamed SSE responses included), with flow control
both ways.

`python -m paged_llm.launcher.http_guard --listen HOST:PORT=UPSTREAM_PORT [--listen ...]`; prints
"listening" once every port is bound.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import httptools

from paged_llm.launcher.guard_process import DEFAULT_MAX_BODY_BYTES

MAX_HEAD_BYTES = 64 * 1024
RETRY_AFTER_S = 5
LINGER_S = 2.0
_ALLOWED_METHODS = frozenset({b"GET", b"POST"})
# Hop-by-hop headers the guard itself frames the forwarded request with.
_FRAMING_HEADERS = frozenset({b"transfer-encoding", b"content-length"})


def is_form_content_type(value: bytes) -> bool:
    """A Content-Type evhtp would parse the body of as a form (it matches a prefix; this matches
    more)."""
    return b"x-www-form-urlencoded" in value.lower()


def is_multipart_content_type(value: bytes) -> bool:
    return b"multipart/" in value.lower()


def error_response(status: int, reason: str, message: str, head_only: bool = False) -> bytes:
    body = ('{"error":"' + message.replace('"', "'") + '"}').encode()
    retry = f"Retry-After: {RETRY_AFTER_S}\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


class _Refused(Exception):
    def __init__(self, response: bytes) -> None:
        super().__init__("refused")
        self.response = response


class _Upstream(asyncio.Protocol):
    """Triton's side of one client connection: passes the bytes back, counts finished responses."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self._interim = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.client.send(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.client.close()

    def on_headers_complete(self) -> None:
        self._interim = 100 <= self.parser.get_status_code() < 200  # 100 Continue: not the final answer

    def on_message_complete(self) -> None:
        if not self._interim:
            self.client.response_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost()

    def pause_writing(self) -> None:
        self.client.pause_reading()

    def resume_writing(self) -> None:
        self.client.resume_reading()


class _Client(asyncio.Protocol):
    """One client connection: checks each request's head, forwards it or answers it."""

    def __init__(self, upstream_port: int, max_body_bytes: int) -> None:
        self.upstream_port = upstream_port
        self.max_body_bytes = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self._upstream_failed = False
        self._pending: list[bytes] = []  # for Triton, until its connection is up
        self.parser = httptools.HttpRequestParser(self)
        self._outstanding = 0  # requests forwarded whose response has not ended
        self._refusal: bytes | None = None  # sent once the responses before it have ended
        self._client_eof = False
        self._closed = False
        self._reading_paused = False
        self._lingering = False  # refused and answered: dropping input until LINGER_S or EOF
        self._new_request()

    def _new_request(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._chunked = False
        self._body_bytes = 0

    # client side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(
                lambda: _Upstream(self), "127.0.0.1", self.upstream_port
            )
        except OSError:
            self._upstream_failed = True
            self._pending.clear()
            if self._refusal is None and (self._outstanding or self._head_bytes):  # a request waits
                self._outstanding = 0
                self._refuse(error_response(503, "Service Unavailable", "Triton is not serving (retry)"))
            return
        if self._closed:
            upstream.transport.close()
            return
        self.upstream = upstream
        for data in self._pending:
            upstream.transport.write(data)
        self._pending.clear()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self._closed:
            return  # refused: nothing more from this connection is forwarded
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(error_response(400, "Bad Request", "protocol upgrades are not served"))
        except httptools.HttpParserError as error:
            # A callback refuses by raising _Refused: httptools stops the parse and raises this
            # error with the callback's exception as its context.
            cause = error.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause.response)
            else:
                self._refuse(error_response(400, "Bad Request", "malformed HTTP request"))

    def eof_received(self) -> bool:
        self._client_eof = True
        if not self._outstanding or self._lingering:
            self.close()
        return True  # keep sending the responses still coming

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._new_request()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._grow_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._grow_head(len(name) + len(value) + 4)

    def _grow_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Refused(error_response(431, "Request Header Fields Too Large", "request head too large"))

    def on_headers_complete(self) -> None:
        method = self.parser.get_method()
        refusal = self._check_head(method)
        if refusal is not None:
            raise _Refused(refusal)
        if self._upstream_failed:
            raise _Refused(error_response(503, "Service Unavailable", "Triton is not serving (retry)"))
        lines = [b"%s %s HTTP/%s\r\n" % (method, self._url, self.parser.get_http_version().encode())]
        for name, value in self._headers:
            lowered = name.lower()
            if lowered in _FRAMING_HEADERS or (lowered == b"content-type" and is_form_content_type(value)):
                continue
            lines.append(b"%s: %s\r\n" % (name, value))
        if self._chunked:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        elif self._content_length:
            lines.append(b"Content-Length: %d\r\n" % self._content_length)
        lines.append(b"\r\n")
        self._forward(b"".join(lines))

    def _check_head(self, method: bytes) -> bytes | None:
        if method not in _ALLOWED_METHODS:
            return error_response(
                405, "Method Not Allowed", "Method Not Allowed", head_only=method == b"HEAD"
            )
        self._content_length = 0
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"upgrade":
                return error_response(400, "Bad Request", "protocol upgrades are not served")
            if lowered == b"content-type" and is_multipart_content_type(value):
                return error_response(
                    415,
                    "Unsupported Media Type",
                    "Content-Type multipart is not accepted: send application/json",
                )
            if lowered == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif lowered == b"content-length":
                self._content_length = int(value)  # llhttp has checked it is one number
        if self._content_length > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> bytes:
        return error_response(413, "Content Too Large", f"request body over {self.max_body_bytes} bytes")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.max_body_bytes:  # only a chunked body can get here
            if self._outstanding:  # a response before it is still coming: no way to answer in order
                self.close()
                return
            raise _Refused(self._too_large())  # Triton's connection closes with the request unfinished
        self._forward(b"%x\r\n%s\r\n" % (len(body), body) if self._chunked else body)

    def on_message_complete(self) -> None:
        if self._chunked:
            self._forward(b"0\r\n\r\n")
        self._outstanding += 1
        self._head_bytes = 0

    # plumbing

    def _forward(self, data: bytes) -> None:
        if self._closed:
            return
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.write(data)
        else:
            self._pending.append(data)

    def _refuse(self, refusal: bytes) -> None:
        self._refusal = refusal
        if self.transport is not None:
            self.transport.pause_reading()
        if not self._outstanding:
            self._send_refusal()

    def _send_refusal(self) -> None:
        """Answers, then reads and drops what the client still sends for LINGER_S before closing:
        closing a socket with unread bytes resets the connection, and the client would see the
        reset instead of the answer (a body it is still sending, as curl does)."""
        if self.transport is None or self._closed or self._refusal is None:
            self.close()
            return
        self.transport.write(self._refusal)
        self._lingering = True
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self._closed:
            self.transport.write(data)

    def response_done(self) -> None:
        self._outstanding -= 1
        if self._outstanding > 0:
            return
        if self._refusal is not None:
            self._send_refusal()
        elif self._client_eof:
            self.close()

    def upstream_lost(self) -> None:
        if self._lingering:
            return
        if self._refusal is not None and self._outstanding:
            self._outstanding = 0
            self._send_refusal()  # Triton went away mid-response: the client's connection ends too
        else:
            self.close()

    def pause_reading(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self._reading_paused and self._refusal is None:
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.transport is not None:
                self.transport.close()  # after what is buffered
            if self.upstream is not None and self.upstream.transport is not None:
                self.upstream.transport.close()


async def serve(listens: list[tuple[str, int, int]], max_body_bytes: int, ready: asyncio.Event | None = None):
    """Listens on each (host, port) and forwards to 127.0.0.1:upstream_port until cancelled."""
    loop = asyncio.get_running_loop()
    servers = []
    for host, port, upstream_port in listens:
        servers.append(
            await loop.create_server(
                lambda upstream_port=upstream_port: _Client(upstream_port, max_body_bytes),
                host,
                port,
                reuse_address=True,
            )
        )
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        for server in servers:
            server.close()


def parse_listen(value: str) -> tuple[str, int, int]:
    """HOST:PORT=UPSTREAM_PORT ([::]:8000=41234 for IPv6)."""
    public, sep, upstream = value.rpartition("=")
    host, colon, port = public.rpartition(":")
    if not (sep and colon and host and port.isdigit() and upstream.isdigit()):
        raise argparse.ArgumentTypeError(f"{value!r}: expected HOST:PORT=UPSTREAM_PORT")
    return host.strip("[]"), int(port), int(upstream)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_llm.launcher.http_guard")
    parser.add_argument("--listen", type=parse_listen, action="append", required=True)
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        ready = asyncio.Event()
        task = asyncio.get_running_loop().create_task(serve(args.listen, args.max_body_bytes, ready))
        # SIGTERM from the launcher once tritonserver has exited; Ctrl-C (SIGINT to the whole
        # process group) is the launcher's to act on, and the guard serves until Triton is gone.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await ready.wait()
        print("listening", flush=True)
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(run())
    except OSError as error:
        print(f"http_guard: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
