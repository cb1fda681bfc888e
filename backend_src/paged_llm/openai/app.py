"""FastAPI application: the OpenAI routes over TritonClient.

A request's life: API key (ASGI middleware, before the body is read) -> body read up to
max_body_bytes (413 past it) -> validated (protocol.py, 400 naming the field) -> model known (404)
-> one Triton stream per prompt (HTTP generate_stream, or gRPC) -> one JSON body, or SSE chunks
ending with `data: [DONE]`.
Streaming responses start only after the first tokens arrived, so an error the engine finds in the
request (prompt too long, queue full) is still an HTTP status, not an SSE event. A client that goes
away (before or during the stream) closes the Triton streams, which cancels the Triton requests.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_llm.openai.chat_template import ChatTemplates
from paged_llm.openai.edge import (
    ApiKeyMiddleware,
    ClientDisconnected,
    ClosingStreamingResponse,
    DisconnectWatch,
    read_body,
    until_disconnect,
)
from paged_llm.openai.errors import INTERNAL_ERROR, OpenAIError
from paged_llm.openai.generation import Generation, merge_streams
from paged_llm.openai.metrics import OpenAIMetrics
from paged_llm.openai.model_list import ModelList
from paged_llm.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from paged_llm.openai.responses import (
    CompletionLogprobs,
    ResponseBuilder,
    chat_logprobs,
    sse,
)
from paged_llm.openai.sse_stream import sse_body
from paged_llm.openai.triton_client import TritonClient
from paged_llm.openai.triton_request import GenerationChunk, GenerationRequest
from paged_llm.parent_death import process_is_alive

logger = logging.getLogger(__name__)
T = TypeVar("T")
try:
    __version__ = importlib.metadata.version("paged_llm")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was not installed
    __version__ = "0+unknown"
_MODELS_CACHE_S = 2.0
_METRICS_PUBLISH_S = 1.0
# How long a worker's start-up waits for its first warm-up attempt (it listens only after it), and
# how often a warm-up that found tritonserver not answering is tried again (/health says 503 meanwhile).
WARM_UP_WAIT_S = 120.0
WARM_UP_RETRY_S = 1.0


@dataclass(frozen=True)
class OpenAISettings:
    triton_url: str  # host:port of Triton's gRPC endpoint
    # host:port of Triton's HTTP endpoint: generation requests then go over HTTP generate_stream
    # (cheaper per streamed response in Python than gRPC, triton_http.py); None: over gRPC.
    triton_http_url: str | None = None
    api_keys: tuple[str, ...] = ()  # none: no key needed
    health_model: str = "llm"  # /health is ready when Triton and this model are
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)  # model -> checkpoint dir (chat, echo)
    default_tokenizer_dir: Path | None = None
    max_body_bytes: int = 16 << 20
    # "auto": sampling parameters a request leaves unset take the checkpoint's generation_config.json
    # values (vLLM's default); "vllm": the engine's defaults (temperature 1, no top_p / top_k)
    generation_config: str = "auto"
    # With several worker processes: each writes its figures here every second, and /metrics in
    # any of them answers the sum.
    metrics_dir: Path | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "triton_url": self.triton_url,
                "triton_http_url": self.triton_http_url,
                "api_keys": list(self.api_keys),
                "health_model": self.health_model,
                "tokenizer_dirs": {k: str(v) for k, v in self.tokenizer_dirs.items()},
                "default_tokenizer_dir": str(self.default_tokenizer_dir)
                if self.default_tokenizer_dir
                else None,
                "max_body_bytes": self.max_body_bytes,
                "generation_config": self.generation_config,
                "metrics_dir": str(self.metrics_dir) if self.metrics_dir else None,
            }
        )

    @staticmethod
    def from_json(text: str) -> OpenAISettings:
        data = json.loads(text)
        return OpenAISettings(
            triton_url=data["triton_url"],
            triton_http_url=data.get("triton_http_url"),
            api_keys=tuple(data["api_keys"]),
            health_model=data["health_model"],
            tokenizer_dirs={k: Path(v) for k, v in data["tokenizer_dirs"].items()},
            default_tokenizer_dir=Path(data["default_tokenizer_dir"])
            if data["default_tokenizer_dir"]
            else None,
            max_body_bytes=data["max_body_bytes"],
            generation_config=data.get("generation_config", "auto"),
            metrics_dir=Path(data["metrics_dir"]) if data["metrics_dir"] else None,
        )


def create_app(settings: OpenAISettings) -> FastAPI:
    metrics = OpenAIMetrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = TritonClient(
            settings.triton_url, settings.api_keys[0] if settings.api_keys else None, settings.triton_http_url
        )
        state["backend"] = backend
        state["models"] = ModelList(backend.ready_models, _MODELS_CACHE_S)
        state["chat"] = ChatTemplates(settings.tokenizer_dirs, settings.default_tokenizer_dir, backend)
        publisher = asyncio.create_task(_publish_metrics()) if settings.metrics_dir else None
        # Warm before listening: uvicorn opens the socket after this start-up, so no request (and,
        # with several workers, no connection the kernel would hand this one) meets a cold worker.
        first_attempt = asyncio.Event()
        warming = asyncio.create_task(_warm_up(first_attempt))
        try:
            await asyncio.wait_for(first_attempt.wait(), WARM_UP_WAIT_S)
        except TimeoutError:
            logger.warning("warming up takes more than %.0f s: listening meanwhile", WARM_UP_WAIT_S)
        try:
            yield
        finally:
            warming.cancel()
            if publisher is not None:
                publisher.cancel()
                _write_metrics()
            await backend.close()

    async def _warm_up(first_attempt: asyncio.Event) -> None:
        """Pays what a model's first request would (state["warm"] once done): the tokenizer and
        chat template loaded and the template rendered once, the generation_config defaults read,
        the model list and configs asked of tritonserver. Tried again while tritonserver does not
        answer (/health says 503 meanwhile)."""
        models = list(dict.fromkeys([settings.health_model, *settings.tokenizer_dirs]))
        started = time.monotonic()
        while True:
            try:
                if await state["chat"].warm_up(models, state["models"]):
                    break
            except Exception:  # a bug of ours: /health stays 503 and says so in the log
                logger.exception("warming up the OpenAI server failed")
            first_attempt.set()  # (tritonserver not answering yet: listen, say 503 and try again)
            await asyncio.sleep(WARM_UP_RETRY_S)
        state["warm"] = True
        first_attempt.set()
        logger.info(
            "OpenAI server worker %d warm in %.1f s (tokenizer, chat template and sampling defaults of %s)",
            os.getpid(), time.monotonic() - started, ", ".join(models),
        )  # fmt: skip

    def _write_metrics() -> None:
        assert settings.metrics_dir is not None
        path = settings.metrics_dir / f"{os.getpid()}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(metrics.to_dict()))
        temporary.replace(path)  # atomic: a reader never sees half a file

    async def _publish_metrics() -> None:
        while True:
            try:
                _write_metrics()
            except OSError as error:
                logger.warning("could not publish this worker's metrics: %s", error)
            await asyncio.sleep(_METRICS_PUBLISH_S)

    def _other_workers_metrics() -> list[dict]:
        if settings.metrics_dir is None:
            return []
        states = []
        for path in settings.metrics_dir.glob("*.json"):
            if path.stem != str(os.getpid()):
                try:
                    state = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue  # a worker replacing its file right now
                if not process_is_alive(int(path.stem)):
                    state["in_flight"] = 0  # a worker that died: its counts stay, its streams do not
                states.append(state)
        return states

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

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, _error: Exception) -> JSONResponse:
        # A bug of ours: OpenAI's shape, no Python text (Starlette logs the traceback after this).
        return JSONResponse(INTERNAL_ERROR.body(), status_code=500)

    # ------------------------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health() -> Response:
        if not state.get("warm"):  # the first request would pay for loading the tokenizer
            return JSONResponse({"status": "warming"}, status_code=503, headers={"Retry-After": "1"})
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
        return PlainTextResponse(
            metrics.render(_other_workers_metrics()), media_type="text/plain; version=0.0.4"
        )

    async def ready_models() -> list[str]:
        try:
            return await state["backend"].ready_models()
        except Exception as error:  # (its text names the client library's status codes: the log's)
            logger.warning("listing tritonserver's models failed: %s", error)
            raise OpenAIError(503, "tritonserver is not reachable") from None

    def model_card(name: str, created: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "paged_llm"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [model_card(name, created) for name in await ready_models()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model not in await ready_models():
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return model_card(model, int(time.time()))

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

    async def completions(request: Request) -> Response:
        return await serve(request, "completions", _completions)

    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat_completions", _chat_completions)

    # Plain Starlette routes: they read the body themselves (protocol.py validates it), so FastAPI's
    # per-request dependency solving would only add to the time before the request reaches Triton.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    async def _completions(request: Request) -> Response:
        start = time.monotonic()
        body: CompletionRequest = parse_body(
            await read_body(request, settings.max_body_bytes), CompletionRequest
        )
        await state["models"].check(body.model)
        prompts = body.prompts()
        echo_texts = [""] * (len(prompts) * body.n)
        if body.echo:
            for position, prompt in enumerate(prompts):
                text = prompt if isinstance(prompt, str) else await state["chat"].decode(body.model, prompt)
                for index in range(body.n):
                    echo_texts[position * body.n + index] = text
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sampling = await with_generation_defaults(body.model, body.sampling_parameters())
        session = session_of(request)
        if session is not None and len(prompts) != 1:
            raise OpenAIError(400, f"a session's turn has one prompt, got {len(prompts)}", "prompt")
        generation_requests = [
            GenerationRequest(
                body.model,
                prompt,
                sampling,
                body.stream,
                body.logprobs is not None,
                f"{request_id}-{i}",
                session,
                body.add_special_tokens if body.add_special_tokens is not None else True,
            )
            for i, prompt in enumerate(prompts)
        ]
        builder = ResponseBuilder("completion", request_id, body.model, body.include_usage)
        generation = Generation(body.n, len(prompts))
        chunks = merge_streams(state["backend"], generation_requests)
        watch = DisconnectWatch(request)
        if not body.stream:
            await _closing_on_disconnect(chunks, until_disconnect(watch, _drain(chunks, generation, start)))
            watch.stop()
            metrics.tokens(*_counts(generation))
            return JSONResponse(
                builder.completion(generation.choices, echo_texts, body.logprobs, generation.usage())
            )
        first = await _first_chunk(watch, chunks)
        logprob_builders = [CompletionLogprobs(body.logprobs or 0) for _ in generation.choices]

        def completion_events(position: int, chunk: GenerationChunk) -> Iterator[bytes]:
            for choice, delta in generation.absorb(position, chunk):
                if not delta.text and delta.finish_reason is None and not delta.num_tokens:
                    continue
                text = delta.text
                if not choice.started:
                    text = echo_texts[choice.index] + text
                    choice.started = True
                if body.logprobs is None:
                    yield builder.text_event(choice.index, text, delta.finish_reason)
                    continue
                logprobs = logprob_builders[choice.index].add(delta.logprobs or [])
                yield sse(builder.completion_chunk(choice.index, text, logprobs, delta.finish_reason))

        return _sse_response(
            chunks,
            first,
            generation,
            builder,
            body.include_usage,
            "completions",
            start,
            completion_events,
            watch,
        )

    async def with_generation_defaults(model: str, sampling: dict[str, Any]) -> dict[str, Any]:
        if settings.generation_config == "auto":
            for name, value in (await state["chat"].generation_defaults(model)).items():
                sampling.setdefault(name, value)
        return sampling

    async def _chat_completions(request: Request) -> Response:
        start = time.monotonic()
        body: ChatCompletionRequest = parse_body(
            await read_body(request, settings.max_body_bytes), ChatCompletionRequest
        )
        await state["models"].check(body.model)
        messages = [message.template_dict(i) for i, message in enumerate(body.messages)]
        session = session_of(request)
        prompt = await state["chat"].render(
            body.model,
            messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs,
            after_an_answer=session is not None and not session.get("session_start", False),
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation_request = GenerationRequest(
            body.model,
            prompt,
            await with_generation_defaults(body.model, body.sampling_parameters()),
            body.stream,
            body.logprobs,
            request_id,
            session,
            bool(body.add_special_tokens),  # default off: the template's text holds its own BOS
        )
        logprobs_k = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder("chat", request_id, body.model, body.include_usage)
        generation = Generation(body.n, 1)
        chunks = merge_streams(state["backend"], [generation_request])
        watch = DisconnectWatch(request)
        if not body.stream:
            await _closing_on_disconnect(chunks, until_disconnect(watch, _drain(chunks, generation, start)))
            watch.stop()
            metrics.tokens(*_counts(generation))
            return JSONResponse(builder.chat(generation.choices, logprobs_k, generation.usage()))
        first = await _first_chunk(watch, chunks)

        def chat_events(position: int, chunk: GenerationChunk) -> Iterator[bytes]:
            for choice, delta in generation.absorb(position, chunk):
                if (delta.text or delta.num_tokens) and logprobs_k is None:
                    yield builder.text_event(choice.index, delta.text, None)
                elif delta.text or delta.num_tokens:
                    logprobs = chat_logprobs(delta.logprobs or [], logprobs_k)
                    yield sse(builder.chat_chunk(choice.index, {"content": delta.text}, logprobs, None))
                if delta.finish_reason is not None:
                    yield sse(builder.chat_chunk(choice.index, {}, None, delta.finish_reason))

        roles = [  # the role first, as OpenAI does
            sse(builder.chat_chunk(choice.index, {"role": "assistant", "content": ""}, None, None))
            for choice in generation.choices
        ]
        return _sse_response(
            chunks,
            first,
            generation,
            builder,
            body.include_usage,
            "chat_completions",
            start,
            chat_events,
            watch,
            roles,
        )

    def _sse_response(
        chunks: AsyncIterator[tuple[int, GenerationChunk]],
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
            _note_first_token(item[1], start, route, generation)
            return events_of(*item)

        def epilogue() -> list[bytes]:
            metrics.tokens(*_counts(generation))
            return [sse(builder.usage_chunk(generation.usage()))] if include_usage else []

        body = sse_body(
            chunks, first, events, lambda item: item[1].is_final and single_stream, epilogue, prelude
        )
        return ClosingStreamingResponse(body, watch, media_type="text/event-stream")

    async def _drain(
        chunks: AsyncIterator[tuple[int, GenerationChunk]], generation: Generation, start: float
    ) -> None:
        async with aclosing(chunks):
            async for position, chunk in chunks:
                generation.absorb(position, chunk)

    def _note_first_token(chunk: GenerationChunk, start: float, route: str, generation: Generation) -> None:
        # (a streamed chunk may carry text but no count: paged_llm_totals_on_final)
        if not generation.first_token_seen and any(
            d.num_tokens or d.text or d.total_tokens for d in chunk.sequences
        ):
            generation.first_token_seen = True
            metrics.first_token(route, time.monotonic() - start)

    return app


SESSION_ID_HEADER = "x-session-id"
SESSION_START_HEADER = "x-session-start"
SESSION_END_HEADER = "x-session-end"


def session_of(request: Request) -> dict[str, Any] | None:
    """The session a request is a turn of, from its headers: X-Session-Id names it, X-Session-Start
    and X-Session-End (true/false, 1/0) open and close it. Its messages (or prompt) are then only
    the turn's new ones: the server keeps the conversation (core/sessions.py)."""
    session_id = request.headers.get(SESSION_ID_HEADER)
    flags = {}
    for name, header in (("session_start", SESSION_START_HEADER), ("session_end", SESSION_END_HEADER)):
        raw = request.headers.get(header)
        if raw is None:
            continue
        if raw.strip().lower() not in ("true", "false", "1", "0"):
            raise OpenAIError(400, f"header {header}: must be true or false, got {raw!r}", header)
        flags[name] = raw.strip().lower() in ("true", "1")
    if session_id is None:
        if flags:
            raise OpenAIError(
                400, f"{SESSION_START_HEADER} and {SESSION_END_HEADER} need {SESSION_ID_HEADER}"
            )
        return None
    return {"session_id": session_id, **flags}


async def _first_chunk(
    watch: DisconnectWatch, chunks: AsyncIterator[tuple[int, GenerationChunk]]
) -> tuple[int, GenerationChunk] | None:
    return await _closing_on_disconnect(chunks, until_disconnect(watch, _next(chunks)))


async def _closing_on_disconnect(chunks: AsyncIterator[Any], awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result; if the client left, `chunks` (the Triton streams) closed first."""
    try:
        return await awaitable
    except ClientDisconnected:
        await chunks.aclose()  # type: ignore[attr-defined]
        raise


async def _next(chunks: AsyncIterator[tuple[int, GenerationChunk]]) -> tuple[int, GenerationChunk] | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _counts(generation: Generation) -> tuple[int, int]:
    used = generation.usage()
    return used["prompt_tokens"], used["completion_tokens"]
