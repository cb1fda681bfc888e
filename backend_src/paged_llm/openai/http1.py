"""A small HTTP/1.1 client for one kind of call: POST a body, read the response body as it streams.

Why not aiohttp: on the OpenAI server's path to Triton each request costs aiohttp about 0.4 ms of
Python before its body is written (ClientRequest, URL, headers, tracing, its response machinery),
measured on the 2-core VM; at a wave of 64 requests over 6 workers that queues each worker's tenth
request several milliseconds behind its first. This client writes a request in one prebuilt
`bytes` on a kept-alive connection and parses the response with httptools (uvicorn's C parser,
chunked transfer included).

One request at a time per connection, no pipelining; idle connections are kept (most recently
used first, for at most _IDLE_S, at most _MAX_IDLE of them). A response read to its end hands its
connection back; closing it earlier closes the connection, which is how Triton learns that the
client went away. A POST is never sent twice (Triton writes a status line only with the first
response, so "no answer yet" does not mean "not received"): a connection the server closed while
idle is skipped when that was seen, and otherwise fails its request, as aiohttp's would.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httptools

_PAUSE_READING_BYTES = 1 << 20  # body bytes waiting for the reader before the socket is paused
_CONNECT_TIMEOUT_S = 5.0
_IDLE_S = 30.0  # an idle connection older than this is closed, not reused
_MAX_IDLE = 1024


class ConnectFailed(ConnectionError):
    """No connection to the server could be opened (nothing was sent)."""


class _Connection(asyncio.Protocol):
    """One TCP connection; httptools calls the on_* methods while feed_data() runs."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.status = 0
        self.keep_alive = False
        self.headers_done = False
        self.complete = False
        self.received_any = False  # a byte of the current response arrived
        self.error: BaseException | None = None
        self._parser: Any = None
        self._body: deque[bytes] = deque()
        self._num_buffered_bytes = 0
        self._paused = False
        self._interim = False
        self._waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0  # (time.monotonic(), when it went back to the pool)

    # ------------------------------------------------------------------------------ asyncio side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no asyncio.Transport subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:  # bytes that answer no request of ours
            self._fail(ConnectionError("the server sent data outside a response"))
            return
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(ConnectionError(f"malformed HTTP response: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if exc is None:
                self.error = ConnectionResetError("the server closed the connection")
            elif isinstance(exc, ConnectionError):
                self.error = exc
            else:
                self.error = ConnectionError(f"{type(exc).__name__}: {exc}")
        self._wake()

    # ---------------------------------------------------------------------------- parser callbacks
    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
            self._interim = True
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._num_buffered_bytes += len(body)
        if self._num_buffered_bytes > _PAUSE_READING_BYTES and not self._paused and self.transport:
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._wake()

    # ----------------------------------------------------------------------------- request side
    def send(self, request: bytes) -> None:
        """Starts a request (the connection is idle)."""
        assert self.transport is not None
        self.status = 0
        self.keep_alive = False
        self.headers_done = self.complete = self.received_any = False
        self.error = None
        self._interim = False
        self.discard_body()
        self._parser = httptools.HttpResponseParser(self)
        self.transport.write(request)

    async def wait(self) -> None:
        """Until something happened (headers, body, the end, an error)."""
        if self.error is not None:
            raise self.error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take_body(self) -> bytes:
        data = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self.discard_body()
        return data

    def discard_body(self) -> None:
        """Drops what the reader did not take, and reads on if reading was paused for it."""
        self._body.clear()
        self._num_buffered_bytes = 0
        if self._paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self._paused = False

    def has_body(self) -> bool:
        return bool(self._body)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class StreamedResponse:
    """A response whose headers arrived; read its body with chunks() or read(), then release()."""

    def __init__(self, client: Http1Client, connection: _Connection) -> None:
        self._client = client
        self._connection: _Connection | None = connection
        self.status = connection.status

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked transfer decoded); ConnectionError if it breaks off."""
        connection = self._connection
        assert connection is not None, "the response was released"
        while True:
            if connection.has_body():
                yield connection.take_body()
                continue
            if connection.complete:
                return
            await connection.wait()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        """Hands the connection back if the body was read to its end, else closes it (the server
        then sees the client leave)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.complete and connection.keep_alive and not connection.closed:
            connection.discard_body()  # (a reader that stopped early may have left some, paused)
            self._client._keep(connection)
        else:
            connection.close()


class Http1Client:
    """Kept-alive connections to one host:port; `post_streamed` is the one call."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        authority = f"[{host}]" if ":" in host else host  # an IPv6 literal
        self._host_header = f"Host: {authority}:{port}\r\n".encode()
        self._idle: list[_Connection] = []  # most recently used last

    async def post_streamed(
        self, path: str, body: bytes, content_type: str = "application/json"
    ) -> StreamedResponse:
        """Sends the request and waits for the response's headers. ConnectFailed if no connection
        could be opened; ConnectionError if the server broke off after the request went out."""
        request = b"".join(
            (
                b"POST ",
                path.encode(),
                b" HTTP/1.1\r\n",
                self._host_header,
                b"Content-Type: ",
                content_type.encode(),
                b"\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
                body,
            )
        )
        connection = self._idle_connection() or await self._connect()
        connection.send(request)
        return await self._headers(connection)

    def _idle_connection(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < _IDLE_S:
                return connection
            connection.close()
        return None

    def _keep(self, connection: _Connection) -> None:
        now = time.monotonic()
        connection.idle_since = now
        self._idle.append(connection)
        # The oldest are at the front: drop the ones the server closed or that waited too long.
        while self._idle and (
            len(self._idle) > _MAX_IDLE or self._idle[0].closed or now - self._idle[0].idle_since >= _IDLE_S
        ):
            self._idle.pop(0).close()

    async def _headers(self, connection: _Connection) -> StreamedResponse:
        try:
            while not connection.headers_done:
                await connection.wait()
        except BaseException:
            connection.close()
            raise
        return StreamedResponse(self, connection)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _transport, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port), _CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as error:  # noqa: UP041 (Python 3.10's differs)
            reason = str(error) or type(error).__name__
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {reason}") from None
        return connection

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
