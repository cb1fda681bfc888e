"""GET /metrics: the OpenAI server's own Prometheus figures (Triton's stay on its metrics port),
summed over the worker processes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse

from paged_llm.openai.state import app_state
from paged_llm.openai.worker_metrics import other_workers


async def prometheus(request: Request) -> PlainTextResponse:
    state = app_state(request)
    return PlainTextResponse(
        state.metrics.render(other_workers(state.settings.metrics_dir)),
        media_type="text/plain; version=0.0.4",
    )
