"""GET /health (what a readiness probe asks: warm, and tritonserver and the health model ready)
and GET /version."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from paged_llm.openai.state import app_state
from paged_llm.openai.version import __version__


async def health(request: Request) -> Response:
    state = app_state(request)
    if not state.warm:  # the first request would pay for loading the tokenizer
        return JSONResponse({"status": "warming"}, status_code=503, headers={"Retry-After": "1"})
    if await state.triton.is_ready(state.settings.health_model):
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "1"})


async def version(request: Request) -> dict[str, str]:
    try:
        triton_version = await app_state(request).triton.server_version()
    except Exception:
        triton_version = ""
    return {"version": __version__, "triton_version": triton_version}
