"""The HTTP edge of the OpenAI server: API keys, the body cap, noticing a client that left."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_llm.frontend.errors import OpenAIError

T = TypeVar("T")
OPEN_PATHS = frozenset({"/health"})


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class ApiKeyMiddleware:
    """Every route but /health needs `Authorization: Bearer KEY` once keys are set. Pure ASGI (not
    BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        matched = False
        for key in self.keys:  # every key compared, each in constant time
            matched |= hmac.compare_digest(token, key)
        return matched

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        if self._authorized(header):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided." if header else "Missing API key: send Authorization: Bearer KEY."
        )
        error = OpenAIError(401, message, None, "invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise OpenAIError(413, f"the request body is {declared} bytes, more than the limit of {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"the request body is more than the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ClientDisconnected (and `awaitable` cancelled) if the client left
    first. A cancellation of the caller itself (server shutdown) cancels both and propagates."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    if task.done():
        watcher.cancel()
        return task.result()  # or the awaitable's own exception
    task.cancel()
    await asyncio.gather(task, watcher, return_exceptions=True)  # (retrieves their exceptions)
    raise ClientDisconnected()


class LastChunk(bytes):
    """A streamed body's last bytes: ClosingStreamingResponse sends them with the end of the body,
    one write instead of two."""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator and reports how the stream ended.
    Starlette cancels the sending task when the client leaves; if that happens while a chunk is
    being written (or before the first), the generator would stay suspended until the garbage
    collector finalizes it, and with it the request's gRPC stream and KV blocks."""

    on_close: Callable[[int], None] | None = None  # called once: 200 if sent to the end, else 499

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            ended = isinstance(chunk, LastChunk)
            await send({"type": "http.response.body", "body": bytes(chunk), "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = self.body_iterator
        sent_all: list[bool] = []

        async def tracked() -> AsyncIterator[Any]:
            async for item in body:
                yield item
            sent_all.append(True)

        self.body_iterator = tracked()
        try:
            # (Starlette returns normally, not with an error, when the client disconnected.)
            await super().__call__(scope, receive, send)
        finally:
            for iterator in (self.body_iterator, body):  # the wrapper may never have started
                close = getattr(iterator, "aclose", None)
                if close is not None:
                    await close()
            if self.on_close is not None:
                self.on_close(200 if sent_all else 499)
