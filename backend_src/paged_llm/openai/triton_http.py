"""Streamed generation requests over Triton's HTTP generate extension (`/v2/models/M/generate_stream`).

Why not gRPC for these: in the OpenAI server's Python, reading one streamed response off a grpc.aio
stream costs about twice what reading one SSE event off an aiohttp connection costs, JSON parsing
included, and opening a gRPC call per request about twice an HTTP request on a kept-alive
connection (measured on the 2-core VM against one tritonserver, client CPU per request: 16
responses 3.7-4.8 ms over gRPC, 1.7-2.0 ms over HTTP; 2 responses 1.25-1.47 / 0.67-0.94 ms). The
gRPC transport stays: for requests that are not streamed, and for a TritonClient without an HTTP URL.

The request is one JSON object: keys that name the model's inputs become inputs (prompt, flags,
sampling_parameters), the others request parameters (paged_llm_error_output, ...). Triton asks a
generate request for every output; `paged_llm_outputs` tells our llm model which ones to build.
An event names no "final" flag: our llm model's final response is the first whose finish_reason
holds no "None" (its streamed responses before the last carry "None" for unfinished samples, or,
with paged_llm_totals_on_final, no finish_reason), and a non-streamed request has one response.
The body is read to its end, so the connection goes back to the pool; closing the generator
before that closes the connection, and Triton cancels the request. The HTTP client is http1.py's
(aiohttp cost ~0.4 ms of Python per request before its body went out).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlsplit

from paged_llm.openai import fast_json
from paged_llm.openai.http1 import ConnectFailed, Http1Client
from paged_llm.openai.triton_request import (
    OUTPUTS_PARAMETER,
    GenerationRequest,
    StreamRefused,
    TritonUnreachable,
    request_inputs,
)

_DATA = b"data: "
_EVENT_END = b"\n\n"
_NOT_OUTPUTS = frozenset({"model_name", "model_version", "id", "parameters"})


def generate_body(
    request: GenerationRequest,
    outputs: tuple[str, ...] | None,
    parameters: dict[str, bool],
    authorization: str | None = None,
) -> bytes:
    """The generate request's JSON: the request's inputs (request_inputs, as over gRPC), then the
    request parameters.
    `authorization` ("Bearer KEY") goes as the request parameter the llm model checks: Triton 2.51
    forwards headers (--http-header-forward-pattern) of `infer` requests, not of `generate` ones."""
    body: dict[str, Any] = dict(request_inputs(request))
    body.update(parameters)
    if outputs:
        body[OUTPUTS_PARAMETER] = ",".join(outputs)
    if authorization:
        body["authorization"] = authorization
    return fast_json.dumps(body)


def event_outputs(event: dict[str, Any]) -> dict[str, list[Any]]:
    """An SSE event's outputs as lists (Triton writes a one-element output as a bare value)."""
    return {
        name: value if isinstance(value, list) else [value]
        for name, value in event.items()
        if name not in _NOT_OUTPUTS
    }


def is_final_response(outputs: dict[str, list[Any]], stream: bool) -> bool:
    """Whether our llm model's response is its last (see the module's docstring)."""
    if not stream:
        return True
    reasons = outputs.get("finish_reason")
    return bool(reasons) and "None" not in reasons


class EventSplitter:
    """The `data:` payloads of an SSE body that arrives in pieces cut anywhere (JSON holds no raw
    newline, so an event ends at the first blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data if self._buffer else data
        payloads = []
        while (end := buffer.find(_EVENT_END)) >= 0:
            line, buffer = buffer[:end], buffer[end + len(_EVENT_END) :]
            if line.startswith(_DATA):
                payloads.append(line[len(_DATA) :])
        self._buffer = buffer
        return payloads


class GenerateStreams:
    """Kept-alive connections to Triton's HTTP endpoint (http1.py)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url  # host:port, as given
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Triton's HTTP endpoint must be host:port or http://host:port, got {url!r}")
        self._authorization = f"Bearer {api_key}" if api_key else None  # checked by the llm model
        self._client = Http1Client(parts.hostname, parts.port or 80)

    async def close(self) -> None:
        self._client.close()

    async def responses(
        self, request: GenerationRequest, outputs: tuple[str, ...] | None, parameters: dict[str, bool]
    ) -> AsyncIterator[tuple[dict[str, list[Any]], bool]]:
        """(outputs, is_final) per response, to the end of the body; StreamRefused, TritonUnreachable."""
        path = f"/v2/models/{quote(request.model, safe='')}/generate_stream"
        body = generate_body(request, outputs, parameters, self._authorization)
        try:
            response = await self._client.post_streamed(path, body)
        except ConnectFailed as error:
            raise TritonUnreachable(str(error), reached=False) from None
        except ConnectionError as error:  # before the status line: Triton did not answer
            raise TritonUnreachable(f"{type(error).__name__}: {error}", reached=False) from None
        try:
            if response.status != 200:
                raise StreamRefused(_error_message(await response.read()))
            splitter = EventSplitter()
            async for data in response.chunks():
                for payload in splitter.feed(data):
                    event = fast_json.loads(payload)
                    if "error" in event:
                        raise StreamRefused(str(event["error"]))
                    outputs_of = event_outputs(event)
                    yield outputs_of, is_final_response(outputs_of, request.stream)
        except ConnectionError as error:
            raise TritonUnreachable(f"{type(error).__name__}: {error}", reached=True) from None
        finally:
            # Read to its end: the connection goes back to the pool; else it is closed (the client
            # went away, or Triton failed), and Triton cancels the request.
            response.release()


def _error_message(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text
