"""A streamed OpenAI response that fails after its first byte ends with an error event in OpenAI's
shape and `data: [DONE]`, whatever broke: the model's error, the Triton stream, this server stopping."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from starlette.requests import Request

from paged_llm.openai.edge import ClosingStreamingResponse, DisconnectWatch
from paged_llm.openai.sse_stream import sse_body
from paged_llm.openai.triton_client import BackendError

_INTERNALS = re.compile(r"Error\b|Exception\b|\bpid\b|\w+\.\w+\(|Traceback")


def _events(body: bytes) -> list[str]:
    return [event.removeprefix("data: ") for event in body.decode().split("\n\n") if event]


async def _items(failure: BaseException | None, wait_forever: bool = False):
    yield "a"
    yield "b"
    if wait_forever:
        await asyncio.Event().wait()
    if failure is not None:
        raise failure


def _body(items) -> object:
    first = "first"
    return sse_body(
        items,
        first,
        lambda item: [f"data: {item}\n\n".encode()],
        lambda item: False,
        lambda: [b"data: usage\n\n"],
        [b"data: prelude\n\n"],
    )


async def _collect(body) -> bytes:
    return b"".join([chunk async for chunk in body])


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (ConnectionResetError("[Errno 104] Connection reset by peer"), 500),  # the Triton stream broke
        (RuntimeError("something of ours"), 500),
        (BackendError(503, "tritonserver stream failed"), 503),
        (BackendError(500, "tritonserver closed the stream before the final response"), 500),
    ],
)
def test_a_stream_failing_mid_way_ends_with_an_error_event_then_done(failure, status):
    events = _events(asyncio.run(_collect(_body(_items(failure)))))
    assert events[:4] == ["prelude", "first", "a", "b"]
    assert events[-2:] == ["usage", "[DONE]"]
    error = json.loads(events[-3])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status == 500 else "service_unavailable_error")
    assert not _INTERNALS.search(error["message"]), error["message"]


def test_a_stream_that_ends_normally_has_no_error_event():
    events = _events(asyncio.run(_collect(_body(_items(None)))))
    assert events == ["prelude", "first", "a", "b", "usage", "[DONE]"]


def test_a_stream_cancelled_by_the_servers_shutdown_still_ends_with_an_error_and_done():
    """uvicorn cancels the responses still streaming when its graceful shutdown ends (and the
    launcher stops the OpenAI server that way when an `llm` stub died): the client still reads an
    error event and `[DONE]`, and the body ends (no chunked encoding cut off)."""

    async def run() -> list[dict]:
        sent: list[dict] = []
        streaming = asyncio.Event()
        complete = asyncio.Event()

        async def send(message):
            sent.append(message)
            if message.get("body"):
                streaming.set()
            if message.get("more_body") is False:
                complete.set()

        async def receive():
            await complete.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        watch = DisconnectWatch(Request(scope, receive, send))
        response = ClosingStreamingResponse(
            _body(_items(None, wait_forever=True)), watch, media_type="text/event-stream"
        )
        task = asyncio.ensure_future(response(scope, receive, send))
        await streaming.wait()
        while b"data: b" not in b"".join(m.get("body", b"") for m in sent):
            await asyncio.sleep(0)
        task.cancel()  # what uvicorn does once its graceful shutdown timed out
        await asyncio.wait_for(asyncio.shield(task), 10)
        return sent

    sent = asyncio.run(run())
    assert sent[-1]["more_body"] is False
    events = _events(b"".join(m.get("body", b"") for m in sent))
    assert events[-2:] == ["usage", "[DONE]"]
    error = json.loads(events[-3])["error"]
    assert error["type"] == "service_unavailable_error" and "stopping" in error["message"]
