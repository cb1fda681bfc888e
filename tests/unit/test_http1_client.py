"""The OpenAI server's HTTP/1.1 client (openai/http1.py) against a local asyncio server that
answers the way Triton's HTTP server does (chunked streams, Content-Length errors, kept-alive
connections), and the ways a server can break off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from paged_llm.openai import fast_json
from paged_llm.openai.http1 import ConnectFailed, Http1Client

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]


class _Server:
    """Reads requests one after the other on each connection; `handler(reader, writer, head,
    body)` answers one and says whether to keep the connection open."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.connection_ended = asyncio.Event()  # a connection's reader saw EOF or a reset
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def __aenter__(self) -> _Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.handler(reader, writer, head, body):
                    return
        finally:
            writer.close()
            self.connection_ended.set()


def _chunked_head(status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    )


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _echo_events(reader, writer, head, body) -> bool:
    """Three SSE events in chunks, the last chunk split byte by byte, then the end."""
    writer.write(_chunked_head())
    for index in range(2):
        writer.write(_chunk(b"data: " + json.dumps({"i": index}).encode() + b"\n\n"))
        await writer.drain()
    last = _chunk(b"data: " + body + b"\n\n") + b"0\r\n\r\n"
    for position in range(len(last)):
        writer.write(last[position : position + 1])
        await writer.drain()
    return True


def test_streams_a_chunked_body_and_keeps_the_connection() -> None:
    async def main() -> None:
        async with _Server(_echo_events) as server:
            client = Http1Client("127.0.0.1", server.port)
            for round_index in range(3):
                response = await client.post_streamed(
                    "/v2/models/llm/generate_stream", b'{"r": %d}' % round_index
                )
                assert response.status == 200
                body = await response.read()
                response.release()
                assert body == b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"r": %d}\n\n' % round_index
            assert server.num_connections == 1  # kept alive
            head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
            assert head[0] == b"POST /v2/models/llm/generate_stream HTTP/1.1"
            assert f"Host: 127.0.0.1:{server.port}".encode() in head
            assert b"Content-Length: 8" in head
            client.close()

    asyncio.run(main())


def test_an_error_status_with_a_content_length_body() -> None:
    async def refuse(reader, writer, head, body) -> bool:
        error = b'{"error":"unknown model"}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(error) + error)
        return True

    async def main() -> None:
        async with _Server(refuse) as server:
            client = Http1Client("127.0.0.1", server.port)
            response = await client.post_streamed("/x", b"{}")
            assert response.status == 400
            assert json.loads(await response.read()) == {"error": "unknown model"}
            response.release()
            response = await client.post_streamed("/x", b"{}")  # the connection was reused
            assert response.status == 400
            await response.read()
            response.release()
            assert server.num_connections == 1
            client.close()

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    async def answer_once(reader, writer, head, body) -> bool:
        writer.write(_chunked_head() + _chunk(b"data: {}\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return False  # then close the connection, though the response said keep-alive

    async def main() -> None:
        async with _Server(answer_once) as server:
            client = Http1Client("127.0.0.1", server.port)
            for _ in range(3):
                response = await client.post_streamed("/x", b"{}")
                assert await response.read() == b"data: {}\n\n"
                response.release()
                await server.connection_ended.wait()
                server.connection_ended.clear()
                for _ in range(5000):  # until the client has seen the close (its event loop ran)
                    if all(connection.closed for connection in client._idle):
                        break
                    await asyncio.sleep(0.001)
            assert server.num_connections == 3
            assert len(server.requests) == 3  # each sent once where it was answered
            client.close()

    asyncio.run(main())


def test_a_large_response_left_unread_does_not_stall_the_next_request() -> None:
    """A body past the pause threshold arrives while nobody reads, and reading pauses. Where the
    pause came after the body's end, the response released unread hands its connection to the
    next request; where it came before (the reads the kernel delivers decide which), release closes
    the connection and the next request opens another. Either way the next request is served."""
    big = b"data: " + b"x" * (1100 * 1024) + b"\n\n"

    async def answer(reader, writer, head, body) -> bool:
        if body == b"big":
            writer.write(_chunked_head() + _chunk(big) + b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return True

    async def main() -> None:
        async with _Server(answer) as server:
            client = Http1Client("127.0.0.1", server.port)
            response = await client.post_streamed("/x", b"big")
            connection = response._connection
            assert connection is not None

            async def settled() -> None:  # complete, or paused for good: however slow the machine
                while not (connection.complete or connection._paused):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(settled(), 60)
            reused = connection.complete
            response.release()
            second = await asyncio.wait_for(client.post_streamed("/x", b"small"), 10)
            assert await second.read() == b"ok"
            second.release()
            assert server.num_connections == (1 if reused else 2)
            client.close()

    asyncio.run(main())


def test_an_interim_response_is_skipped() -> None:
    async def answer(reader, writer, head, body) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(_chunked_head() + _chunk(b"data: {}\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True

    async def main() -> None:
        async with _Server(answer) as server:
            client = Http1Client("127.0.0.1", server.port)
            response = await client.post_streamed("/x", b"{}")
            assert response.status == 200
            assert await response.read() == b"data: {}\n\n"
            response.release()
            client.close()

    asyncio.run(main())


def test_a_request_is_never_sent_twice() -> None:
    """Triton answers a generate_stream request only with its first response: a connection that
    breaks before then may have delivered the request, so it fails and is not sent again."""

    async def read_then_drop(reader, writer, head, body) -> bool:
        if body == b"first":
            writer.write(_chunked_head() + _chunk(b"data: {}\n\n") + b"0\r\n\r\n")
            await writer.drain()
            return True
        await asyncio.sleep(0.2)  # "queued and prefilling", then the connection breaks
        return False

    async def main() -> None:
        async with _Server(read_then_drop) as server:
            client = Http1Client("127.0.0.1", server.port)
            response = await client.post_streamed("/x", b"first")
            await response.read()
            response.release()
            with pytest.raises(ConnectionError):
                await client.post_streamed("/x", b"second")  # on the kept connection
            assert [request.endswith(b"second") for request in server.requests] == [False, True]
            client.close()

    asyncio.run(main())


def test_releasing_a_response_early_closes_its_connection() -> None:
    """What tells Triton that the OpenAI client went away: the connection closes."""
    stop_writing = asyncio.Event()

    async def endless(reader, writer, head, body) -> bool:
        writer.write(_chunked_head())
        try:
            while not stop_writing.is_set():
                writer.write(_chunk(b"data: {}\n\n"))
                await writer.drain()
                await asyncio.sleep(0.001)
        except ConnectionError:
            pass
        return False

    async def main() -> None:
        async with _Server(endless) as server:
            client = Http1Client("127.0.0.1", server.port)
            response = await client.post_streamed("/x", b"{}")
            chunks = response.chunks()
            assert (await chunks.__anext__()).startswith(b"data: {}")
            await chunks.aclose()
            response.release()
            await asyncio.wait_for(server.connection_ended.wait(), 10)
            stop_writing.set()
            response = await client.post_streamed("/x", b"{}")  # a new connection
            assert server.num_connections == 2
            response.release()
            client.close()

    asyncio.run(main())


def test_a_body_broken_off_is_a_connection_error() -> None:
    async def break_off(reader, writer, head, body) -> bool:
        writer.write(_chunked_head() + _chunk(b"data: {}\n\n") + b"40\r\npartial")
        await writer.drain()
        return False

    async def main() -> None:
        async with _Server(break_off) as server:
            client = Http1Client("127.0.0.1", server.port)
            response = await client.post_streamed("/x", b"{}")
            received = []
            with pytest.raises(ConnectionError):
                async for chunk in response.chunks():
                    received.append(chunk)
            assert b"".join(received).startswith(b"data: {}\n\n")
            response.release()
            client.close()

    asyncio.run(main())


def test_no_server_is_connect_failed() -> None:
    async def main() -> None:
        async with _Server(_echo_events) as server:
            port = server.port
        await asyncio.sleep(0)
        client = Http1Client("127.0.0.1", port)
        with pytest.raises(ConnectFailed, match="cannot connect"):
            await client.post_streamed("/x", b"{}")

    asyncio.run(main())


def test_a_malformed_response_is_a_connection_error() -> None:
    async def garbage(reader, writer, head, body) -> bool:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        return False

    async def main() -> None:
        async with _Server(garbage) as server:
            client = Http1Client("127.0.0.1", server.port)
            with pytest.raises(ConnectionError):
                await client.post_streamed("/x", b"{}")
            client.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": [1, 2, 3], "b": "x\\u00e9", "c": null, "d": 1.5, "e": true}',
        b'{"big": 123456789012345678901234567890}',  # past 64 bits: the standard library's
        '{"bom": 1}'.encode("utf-16"),  # not UTF-8: the standard library's
        b'{"lone": "\\ud800"}',  # orjson refuses a lone surrogate; json reads it
    ],
)
def test_fast_json_loads_as_the_standard_library(raw: bytes) -> None:
    assert fast_json.loads(raw) == json.loads(raw)


def test_fast_json_errors_and_constants_are_the_standard_librarys() -> None:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not a JSON number")

    with pytest.raises(ValueError, match="NaN is not a JSON number"):
        fast_json.loads(b'{"t": NaN}', parse_constant=refuse)
    with pytest.raises(json.JSONDecodeError):
        fast_json.loads(b'{"t": ')
    value = {"ids": [1, 2], "text": "caf\u00e9", "flag": True, "big": 2**70}
    assert json.loads(fast_json.dumps(value)) == value
