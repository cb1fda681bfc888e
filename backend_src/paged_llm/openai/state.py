"""What the routes share (AppState), and the app's life that builds it: at start-up the client of
tritonserver, the model list and the chat templates, warmed before uvicorn listens; at shutdown
the metrics published once more and the client closed."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request

from paged_llm.openai import worker_metrics
from paged_llm.openai.chat_template import ChatTemplates
from paged_llm.openai.metrics import OpenAIMetrics
from paged_llm.openai.model_list import ModelList
from paged_llm.openai.settings import OpenAISettings
from paged_llm.openai.triton_client import TritonClient

logger = logging.getLogger(__name__)
_MODELS_CACHE_S = 2.0
# How long a worker's start-up waits for its first warm-up attempt (it listens only after it), and
# how often a warm-up that found tritonserver not answering is tried again (/health says 503 meanwhile).
WARM_UP_WAIT_S = 120.0
WARM_UP_RETRY_S = 1.0


@dataclass
class AppState:
    """One worker's state, built by its lifespan before any request (app.state.server)."""

    settings: OpenAISettings
    metrics: OpenAIMetrics
    triton: TritonClient
    models: ModelList
    chat: ChatTemplates
    warm: bool = False  # warm_up() finished: until then /health says 503


def app_state(request: Request) -> AppState:
    return request.app.state.server


def lifespan_of(
    settings: OpenAISettings, metrics: OpenAIMetrics
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        triton = TritonClient(
            settings.triton_url, settings.api_keys[0] if settings.api_keys else None, settings.triton_http_url
        )
        state = AppState(
            settings,
            metrics,
            triton,
            ModelList(triton.ready_models, _MODELS_CACHE_S),
            ChatTemplates(
                settings.tokenizer_dirs, settings.default_tokenizer_dir, triton, settings.chat_template
            ),
        )
        app.state.server = state
        directory = settings.metrics_dir
        publisher = asyncio.create_task(worker_metrics.publish(metrics, directory)) if directory else None
        # Warm before listening: uvicorn opens the socket after this start-up, so no request (and,
        # with several workers, no connection the kernel would hand this one) meets a cold worker.
        first_attempt = asyncio.Event()
        warming = asyncio.create_task(_warm_up(state, first_attempt))
        try:
            await asyncio.wait_for(first_attempt.wait(), WARM_UP_WAIT_S)
        except TimeoutError:
            logger.warning("warming up takes more than %.0f s: listening meanwhile", WARM_UP_WAIT_S)
        try:
            yield
        finally:
            warming.cancel()
            if publisher is not None:
                assert directory is not None
                publisher.cancel()
                worker_metrics.write_own(metrics, directory)
            await triton.close()

    return lifespan


async def _warm_up(state: AppState, first_attempt: asyncio.Event) -> None:
    """Pays what a model's first request would (state.warm once done): the tokenizer and chat
    template loaded and the template rendered once, the generation_config defaults read, the model
    list and configs asked of tritonserver. Tried again while tritonserver does not answer (/health
    says 503 meanwhile)."""
    settings = state.settings
    models = list(dict.fromkeys([settings.health_model, *settings.tokenizer_dirs]))
    started = time.monotonic()
    while True:
        try:
            if await state.chat.warm_up(models, state.models):
                break
        except Exception:  # a bug of ours: /health stays 503 and says so in the log
            logger.exception("warming up the OpenAI server failed")
        first_attempt.set()  # (tritonserver not answering yet: listen, say 503 and try again)
        await asyncio.sleep(WARM_UP_RETRY_S)
    state.warm = True
    first_attempt.set()
    logger.info(
        "OpenAI server worker %d warm in %.1f s (tokenizer, chat template and sampling defaults of %s)",
        os.getpid(), time.monotonic() - started, ", ".join(models),
    )  # fmt: skip
