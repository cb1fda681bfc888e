"""What POST /v1/completions and /v1/chat/completions share: the request counted (a stream when it
ends), sampling defaults, a non-streamed answer collected, the SSE response of a streamed one, and
the Triton streams closed when the client leaves (which cancels the Triton requests).

Streaming responses start only after the first tokens arrived, so an error the engine finds in the
request (prompt too long, queue full) is still an HTTP status, not an SSE event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from paged_llm.openai.constraints import Constraint
from paged_llm.openai.edge import (
    ClientDisconnected,
    ClosingStreamingResponse,
    DisconnectWatch,
    until_disconnect,
)
from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.generation import Generation
from paged_llm.openai.metrics import OpenAIMetrics
from paged_llm.openai.responses import ResponseBuilder, sse
from paged_llm.openai.sse_stream import sse_body
from paged_llm.openai.state import AppState, app_state
from paged_llm.openai.triton_request import GenerationChunk

T = TypeVar("T")
Chunks = AsyncIterator[tuple[int, GenerationChunk]]  # (prompt position, chunk), merge_streams()'s


async def model_and_adapter(state: AppState, requested: str) -> tuple[str, str | None]:
    """The Triton model a request's `model` names and its LoRA adapter (None: the base model); a
    404 for a name that is neither a served model nor an adapter. With runtime LoRA updates, a
    name Triton does not serve is looked up among --health-model's adapters (another worker may
    have loaded it), once: this worker then routes it at once."""
    settings = state.settings
    if requested in state.models.names:  # a served model's name is never an adapter's
        return requested, None
    model, lora_name = settings.target(requested)
    try:
        await state.models.check(model)
    except OpenAIError as error:
        if lora_name is not None or not settings.allow_runtime_lora_updates or error.status_code != 404:
            raise
        await state.models.check(settings.health_model)
        names = await state.triton.lora_admin(settings.health_model, {"action": "list"})
        if requested not in names:
            raise
        settings.lora_adapters[requested] = settings.health_model
        model, lora_name = settings.health_model, requested
    return model, lora_name


async def serve(request: Request, route: str, handler: Callable[[Request], Awaitable[Response]]) -> Response:
    """Runs a generation route and counts it (a stream is counted when it ends)."""
    metrics = app_state(request).metrics
    start = time.monotonic()
    metrics.started()
    try:
        response = await handler(request)
    except OpenAIError as error:
        DisconnectWatch.stop_of(request)
        metrics.finished(route, error.status_code, time.monotonic() - start)
        raise
    except ClientDisconnected:
        metrics.finished(route, 499, time.monotonic() - start)  # nginx's "client closed request"
        return Response(status_code=499)
    except BaseException:
        DisconnectWatch.stop_of(request)
        metrics.finished(route, 500, time.monotonic() - start)
        raise
    if isinstance(response, ClosingStreamingResponse):
        response.on_close = lambda status: metrics.finished(route, status, time.monotonic() - start)
    else:
        metrics.finished(route, response.status_code, time.monotonic() - start)
    return response


async def with_generation_defaults(state: AppState, model: str, sampling: dict[str, Any]) -> dict[str, Any]:
    if state.settings.generation_config == "auto":
        for name, value in (await state.chat.generation_defaults(model)).items():
            sampling.setdefault(name, value)
    return sampling


async def naming_the_constraint(chunks: Chunks, constraint: Constraint) -> Chunks:
    """`chunks`, an error the engine sends about the request's constraint naming the client's field
    (`guided_regex`, not `structured_outputs.regex`)."""
    async with aclosing(chunks):  # type: ignore[type-var]
        try:
            async for item in chunks:
                yield item
        except OpenAIError as error:
            raise constraint.client_error(error) from None


async def collect(state: AppState, chunks: Chunks, generation: Generation, watch: DisconnectWatch) -> None:
    """A request that is not streamed: every chunk absorbed into `generation` (the Triton streams
    closed if the client leaves first), the watch stopped, the tokens counted."""
    await _closing_on_disconnect(chunks, until_disconnect(watch, _drain(chunks, generation)))
    watch.stop()
    state.metrics.tokens(*_counts(generation))


async def first_chunk(watch: DisconnectWatch, chunks: Chunks) -> tuple[int, GenerationChunk] | None:
    return await _closing_on_disconnect(chunks, until_disconnect(watch, _next(chunks)))


def sse_response(
    state: AppState,
    chunks: Chunks,
    first: tuple[int, GenerationChunk] | None,
    generation: Generation,
    builder: ResponseBuilder,
    include_usage: bool,
    route: str,
    start: float,
    events_of: Callable[[int, GenerationChunk], Iterator[bytes]],
    watch: DisconnectWatch,
    prelude: list[bytes] | None = None,
) -> StreamingResponse:
    """The SSE stream of a request whose first chunk arrived (sse_stream.py): `prelude`, the
    events of each chunk, an error event if it fails, the usage chunk if asked, `data: [DONE]`."""
    single_stream = generation.num_prompts == 1  # (else a final chunk may not be the last)

    def events(item: tuple[int, GenerationChunk]) -> Iterator[bytes]:
        _note_first_token(state.metrics, item[1], start, route, generation)
        return events_of(*item)

    def epilogue() -> list[bytes]:
        state.metrics.tokens(*_counts(generation))
        return [sse(builder.usage_chunk(generation.usage()))] if include_usage else []

    body = sse_body(chunks, first, events, lambda item: item[1].is_final and single_stream, epilogue, prelude)
    return ClosingStreamingResponse(body, watch, media_type="text/event-stream")


async def _drain(chunks: Chunks, generation: Generation) -> None:
    async with aclosing(chunks):
        async for position, chunk in chunks:
            generation.absorb(position, chunk)


def _note_first_token(
    metrics: OpenAIMetrics, chunk: GenerationChunk, start: float, route: str, generation: Generation
) -> None:
    # (a streamed chunk may carry text but no count: paged_llm_totals_on_final)
    if not generation.first_token_seen and any(
        d.num_tokens or d.text or d.total_tokens for d in chunk.sequences
    ):
        generation.first_token_seen = True
        metrics.first_token(route, time.monotonic() - start)


async def _closing_on_disconnect(chunks: AsyncIterator[Any], awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result; if the client left, `chunks` (the Triton streams) closed first."""
    try:
        return await awaitable
    except ClientDisconnected:
        await chunks.aclose()  # type: ignore[attr-defined]
        raise


async def _next(chunks: Chunks) -> tuple[int, GenerationChunk] | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _counts(generation: Generation) -> tuple[int, int]:
    used = generation.usage()
    return used["prompt_tokens"], used["completion_tokens"]
