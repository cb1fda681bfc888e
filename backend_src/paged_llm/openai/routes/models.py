"""GET /v1/models and GET /v1/models/{model}: tritonserver's ready models, as OpenAI model cards."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request

from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.state import app_state

logger = logging.getLogger(__name__)


async def _ready_models(request: Request) -> list[str]:
    try:
        return await app_state(request).triton.ready_models()
    except Exception as error:  # (its text names the client library's status codes: the log's)
        logger.warning("listing tritonserver's models failed: %s", error)
        raise OpenAIError(503, "tritonserver is not reachable") from None


def _model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "paged_llm"}


async def models(request: Request) -> dict[str, Any]:
    created = int(time.time())
    return {"object": "list", "data": [_model_card(name, created) for name in await _ready_models(request)]}


async def model(model: str, request: Request) -> dict[str, Any]:
    if model not in await _ready_models(request):
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return _model_card(model, int(time.time()))
