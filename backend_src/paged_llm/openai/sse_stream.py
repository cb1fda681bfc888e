"""The SSE body of a streamed completion once its first chunk arrived: every way it can end
(the last chunk, an error the model sent, the Triton stream breaking, this server stopping) ends
with an event and `data: [DONE]`, so that a client never sees a stream cut off mid-way.

A failure after the first byte cannot be an HTTP status any more: it becomes an error event in
OpenAI's shape (`data: {"error": {...}}`, as vLLM sends it), then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from typing import TypeVar

from paged_llm.openai.edge import LastChunk
from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.responses import SSE_DONE, sse

logger = logging.getLogger(__name__)
Item = TypeVar("Item")
# What the client reads when the stream failed for a reason of ours (the log has the details).
STREAM_FAILED = OpenAIError(500, "the stream failed before its final response (the server log says why)")
SERVER_STOPPING = OpenAIError(503, "the server is stopping; the stream ended before its final response")


def error_event(error: BaseException) -> bytes:
    """The SSE event a stream that failed with `error` ends with (before `data: [DONE]`)."""
    if isinstance(error, OpenAIError):
        return sse(error.body())
    if isinstance(error, asyncio.CancelledError):
        return sse(SERVER_STOPPING.body())
    return sse(STREAM_FAILED.body())


async def sse_body(
    items: AsyncIterator[Item],
    first: Item | None,
    events_of: Callable[[Item], Iterable[bytes]],
    is_last: Callable[[Item], bool],
    epilogue: Callable[[], list[bytes]],
    prelude: list[bytes] | None = None,
) -> AsyncIterator[bytes]:
    """`prelude`, the events of `first` and of each further item of `items`, an error event if
    they fail, `epilogue()` (e.g. the usage chunk) and `data: [DONE]`. Events that are ready
    together go out in one write: an item's (the first's with the prelude), and the last item's
    with what follows it and the end of the body (LastChunk; `is_last` says which item that is).

    A cancellation of the task reading `items` (uvicorn cancels a response still streaming when
    its graceful shutdown ends) also ends the body with an error event and `[DONE]`; one that
    came from the client leaving is dropped by ClosingStreamingResponse, which sends nothing more
    once its DisconnectWatch saw the disconnect."""
    async with aclosing(items):  # type: ignore[type-var]
        pending = list(prelude or [])
        try:
            item = first
            while item is not None:
                pending.extend(events_of(item))
                if pending and not is_last(item):
                    yield b"".join(pending)
                    pending.clear()
                item = await _next(items)
        except OpenAIError as error:
            pending.append(error_event(error))
        except asyncio.CancelledError as error:
            pending.append(error_event(error))
        except Exception as error:
            logger.exception("a streamed response failed after its first event")
            pending.append(error_event(error))
        pending.extend(epilogue())
        pending.append(SSE_DONE)
        yield LastChunk(b"".join(pending))


async def _next(items: AsyncIterator[Item]) -> Item | None:
    try:
        return await items.__anext__()
    except StopAsyncIteration:
        return None
