"""FastAPI application: the OpenAI routes over TritonBackend.

A request's life: API key (ASGI middleware, before the body is read) -> body read up to
max_body_bytes (413 past it) -> validated (protocol.py, 400 naming the field) -> model known (404)
-> one gRPC stream per prompt -> one JSON body, or SSE chunks ending with `data: [DONE]`.
Streaming responses start only after the first tokens arrived, so an error the engine finds in the
request (prompt too long, queue full) is still an HTTP status, not an SSE event. A client that goes
away (before or during the stream) closes the gRPC streams, which cancels the Triton requests.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_llm.frontend.chat_template import ChatTemplates
from paged_llm.frontend.errors import OpenAIError
from paged_llm.frontend.metrics import FrontendMetrics
from paged_llm.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from paged_llm.frontend.responses import (
    SSE_DONE,
    Choice,
    CompletionLogprobs,
    ResponseBuilder,
    chat_logprobs,
    sse,
    usage,
)
from paged_llm.frontend.triton_backend import GenerationChunk, GenerationRequest, TritonBackend

logger = logging.getLogger(__name__)
try:
    __version__ = importlib.metadata.version("paged_llm")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was not installed
    __version__ = "0+unknown"
T = TypeVar("T")
_MODELS_CACHE_S = 2.0
_OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class FrontendSettings:
    triton_url: str  # host:port of Triton's gRPC endpoint
    api_keys: tuple[str, ...] = ()  # none: no key needed
    health_model: str = "llm"  # /health is ready when Triton and this model are
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)  # model -> checkpoint dir (chat, echo)
    default_tokenizer_dir: Path | None = None
    max_body_bytes: int = 16 << 20


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
        if scope["type"] != "http" or not self.keys or scope["path"] in _OPEN_PATHS:
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
    """`awaitable`'s result, or ClientDisconnected (and `awaitable` cancelled) if the client left."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected()
    return task.result()


class _Done:
    pass


async def merge_streams(
    backend: TritonBackend, requests: list[GenerationRequest]
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """The chunks of several requests as they come, tagged with the request's position."""
    if len(requests) == 1:
        async with aclosing(backend.generate(requests[0])) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk | None, BaseException | _Done | None]] = asyncio.Queue()

    async def pump(position: int, request: GenerationRequest) -> None:
        try:
            async with aclosing(backend.generate(request)) as chunks:
                async for chunk in chunks:
                    await queue.put((position, chunk, None))
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            await queue.put((position, None, error))
        await queue.put((position, None, _Done()))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            position, chunk, status = await queue.get()
            if isinstance(status, _Done):
                remaining -= 1
            elif status is not None:
                raise status
            else:
                assert chunk is not None
                yield position, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Generation:
    """One OpenAI request in flight: its choices and token counts."""

    n: int
    num_prompts: int
    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    first_token_seen: bool = False

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n * self.num_prompts)]

    def absorb(self, position: int, chunk: GenerationChunk) -> list[tuple[Choice, Any]]:
        if chunk.num_prompt_tokens is not None:
            self.prompt_tokens[position] = chunk.num_prompt_tokens
        touched = []
        for delta in chunk.sequences:
            choice = self.choices[position * self.n + delta.index]
            choice.add(delta)
            touched.append((choice, delta))
        return touched

    def usage(self) -> dict[str, int]:
        return usage(sum(self.prompt_tokens.values()), sum(c.num_tokens for c in self.choices))


def create_app(settings: FrontendSettings) -> FastAPI:
    metrics = FrontendMetrics()
    state: dict[str, Any] = {"models": (), "models_at": 0.0}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = TritonBackend(settings.triton_url)
        state["backend"] = backend
        state["chat"] = ChatTemplates(settings.tokenizer_dirs, settings.default_tokenizer_dir, backend)
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="paged_llm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            OpenAIError(error.status_code, str(error.detail)).body(), status_code=error.status_code
        )

    async def known_model(model: str) -> None:
        backend: TritonBackend = state["backend"]
        for refresh in (False, True):
            if refresh or time.monotonic() - state["models_at"] > _MODELS_CACHE_S:
                try:
                    state["models"] = tuple(await backend.ready_models())
                except Exception as error:
                    raise OpenAIError(503, f"tritonserver is not reachable: {error}") from None
                state["models_at"] = time.monotonic()
            if model in state["models"]:
                return
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    # ------------------------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health() -> Response:
        if await state["backend"].is_ready(settings.health_model):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        try:
            triton_version = await state["backend"].server_version()
        except Exception:
            triton_version = ""
        return {"version": __version__, "triton_version": triton_version}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = await state["backend"].ready_models()
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "paged_llm"} for name in names
            ],
        }

    # -------------------------------------------------------------------------- generation routes
    async def serve(
        request: Request, route: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """Runs a generation route and counts it (a stream is counted when it ends)."""
        start = time.monotonic()
        metrics.started()
        try:
            response = await handler(request)
        except OpenAIError as error:
            metrics.finished(route, error.status_code, time.monotonic() - start)
            raise
        except ClientDisconnected:
            metrics.finished(route, 499, time.monotonic() - start)  # nginx's "client closed request"
            return Response(status_code=499)
        except BaseException:
            metrics.finished(route, 500, time.monotonic() - start)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _count_when_done(response.body_iterator, route, start)
        else:
            metrics.finished(route, response.status_code, time.monotonic() - start)
        return response

    async def _count_when_done(body: AsyncIterator[Any], route: str, start: float) -> AsyncIterator[Any]:
        status = 499  # unless the stream runs to its end
        try:
            async for item in body:
                yield item
            status = 200
        finally:
            metrics.finished(route, status, time.monotonic() - start)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions", _completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat_completions", _chat_completions)

    async def _completions(request: Request) -> Response:
        start = time.monotonic()
        body: CompletionRequest = parse_body(
            await read_body(request, settings.max_body_bytes), CompletionRequest
        )
        await known_model(body.model)
        prompts = body.prompts()
        echo_texts = [""] * (len(prompts) * body.n)
        if body.echo:
            for position, prompt in enumerate(prompts):
                text = prompt if isinstance(prompt, str) else await state["chat"].decode(body.model, prompt)
                for index in range(body.n):
                    echo_texts[position * body.n + index] = text
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sampling = body.sampling_parameters()
        generation_requests = [
            GenerationRequest(
                body.model, prompt, sampling, body.stream, body.logprobs is not None, f"{request_id}-{i}"
            )
            for i, prompt in enumerate(prompts)
        ]
        builder = ResponseBuilder("completion", request_id, body.model)
        generation = _Generation(body.n, len(prompts))
        chunks = merge_streams(state["backend"], generation_requests)
        if not body.stream:
            await until_disconnect(request, _drain(chunks, generation, start))
            metrics.tokens(*_counts(generation))
            return JSONResponse(
                builder.completion(generation.choices, echo_texts, body.logprobs, generation.usage())
            )
        first = await until_disconnect(request, _first(chunks))
        logprob_builders = [CompletionLogprobs(body.logprobs or 0) for _ in generation.choices]

        async def events() -> AsyncIterator[bytes]:
            async with aclosing(chunks):
                try:
                    pending = [first] if first is not None else []
                    while True:
                        for position, chunk in pending:
                            _note_first_token(chunk, start, "completions", generation)
                            for choice, delta in generation.absorb(position, chunk):
                                if not delta.text and delta.finish_reason is None and not delta.token_ids:
                                    continue
                                text = delta.text
                                if not choice.started:
                                    text = echo_texts[choice.index] + text
                                    choice.started = True
                                logprobs = None
                                if body.logprobs is not None:
                                    logprobs = logprob_builders[choice.index].add(delta.logprobs or [])
                                yield sse(
                                    builder.completion_chunk(
                                        choice.index, text, logprobs, delta.finish_reason
                                    )
                                )
                        nxt = await _next(chunks)
                        if nxt is None:
                            break
                        pending = [nxt]
                except OpenAIError as error:
                    yield sse(error.body())
                metrics.tokens(*_counts(generation))
                if body.include_usage:
                    yield sse(builder.usage_chunk(generation.usage()))
                yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _chat_completions(request: Request) -> Response:
        start = time.monotonic()
        body: ChatCompletionRequest = parse_body(
            await read_body(request, settings.max_body_bytes), ChatCompletionRequest
        )
        await known_model(body.model)
        messages = [message.template_dict(i) for i, message in enumerate(body.messages)]
        prompt = await state["chat"].render(
            body.model,
            messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation_request = GenerationRequest(
            body.model, prompt, body.sampling_parameters(), body.stream, body.logprobs, request_id
        )
        logprobs_k = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder("chat", request_id, body.model)
        generation = _Generation(body.n, 1)
        chunks = merge_streams(state["backend"], [generation_request])
        if not body.stream:
            await until_disconnect(request, _drain(chunks, generation, start))
            metrics.tokens(*_counts(generation))
            return JSONResponse(builder.chat(generation.choices, logprobs_k, generation.usage()))
        first = await until_disconnect(request, _first(chunks))

        async def events() -> AsyncIterator[bytes]:
            async with aclosing(chunks):
                try:
                    for choice in generation.choices:  # the role first, as OpenAI does
                        yield sse(
                            builder.chat_chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
                        )
                    pending = [first] if first is not None else []
                    while True:
                        for position, chunk in pending:
                            _note_first_token(chunk, start, "chat_completions", generation)
                            for choice, delta in generation.absorb(position, chunk):
                                if delta.text or delta.token_ids:
                                    logprobs = None
                                    if logprobs_k is not None:
                                        logprobs = chat_logprobs(delta.logprobs or [], logprobs_k)
                                    yield sse(
                                        builder.chat_chunk(
                                            choice.index, {"content": delta.text}, logprobs, None
                                        )
                                    )
                                if delta.finish_reason is not None:
                                    yield sse(builder.chat_chunk(choice.index, {}, None, delta.finish_reason))
                        nxt = await _next(chunks)
                        if nxt is None:
                            break
                        pending = [nxt]
                except OpenAIError as error:
                    yield sse(error.body())
                metrics.tokens(*_counts(generation))
                if body.include_usage:
                    yield sse(builder.usage_chunk(generation.usage()))
                yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _drain(
        chunks: AsyncIterator[tuple[int, GenerationChunk]], generation: _Generation, start: float
    ) -> None:
        async with aclosing(chunks):
            async for position, chunk in chunks:
                generation.absorb(position, chunk)

    def _note_first_token(chunk: GenerationChunk, start: float, route: str, generation: _Generation) -> None:
        if not generation.first_token_seen and any(d.token_ids for d in chunk.sequences):
            generation.first_token_seen = True
            metrics.first_token(route, time.monotonic() - start)

    return app


async def _first(chunks: AsyncIterator[tuple[int, GenerationChunk]]) -> tuple[int, GenerationChunk] | None:
    return await _next(chunks)


async def _next(chunks: AsyncIterator[tuple[int, GenerationChunk]]) -> tuple[int, GenerationChunk] | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _counts(generation: _Generation) -> tuple[int, int]:
    used = generation.usage()
    return used["prompt_tokens"], used["completion_tokens"]
