"""The FastAPI application: the OpenAI routes (routes/) over the worker's state (state.py).

A request's life: API key (ASGI middleware, before the body is read) -> body read up to
max_body_bytes (413 past it) -> validated (protocol.py, 400 naming the field) -> model known (404)
-> one Triton stream per prompt (HTTP generate_stream, or gRPC) -> one JSON body, or SSE chunks
ending with `data: [DONE]`. A client that goes away (before or during the stream) closes the Triton
streams, which cancels the Triton requests (routes/generation_flow.py).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_llm.openai.edge import ApiKeyMiddleware
from paged_llm.openai.errors import INTERNAL_ERROR, OpenAIError
from paged_llm.openai.metrics import OpenAIMetrics
from paged_llm.openai.routes import chat, completions, lora_adapters, models, prometheus, status
from paged_llm.openai.settings import OpenAISettings
from paged_llm.openai.state import lifespan_of
from paged_llm.openai.version import __version__


def create_app(settings: OpenAISettings) -> FastAPI:
    app = FastAPI(
        title="paged_llm OpenAI-compatible server",
        version=__version__,
        lifespan=lifespan_of(settings, OpenAIMetrics()),
    )
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

    # Added one by one, not as included routers: a request then meets a flat list of routes.
    app.add_api_route("/health", status.health, methods=["GET"])
    app.add_api_route("/version", status.version, methods=["GET"])
    app.add_api_route("/metrics", prometheus.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", models.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", models.model, methods=["GET"])
    # Plain Starlette routes: they read the body themselves (protocol.py validates it), so FastAPI's
    # per-request dependency solving would only add to the time before the request reaches Triton.
    app.add_route("/v1/completions", completions.completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat.chat_completions, methods=["POST"])
    if settings.allow_runtime_lora_updates:  # (vLLM: only with VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        app.add_route("/v1/load_lora_adapter", lora_adapters.load_lora_adapter, methods=["POST"])
        app.add_route("/v1/unload_lora_adapter", lora_adapters.unload_lora_adapter, methods=["POST"])
    return app
