"""GET /v1/models and GET /v1/models/{model}: tritonserver's ready models, as OpenAI model cards,
and the LoRA adapters they serve (cards with their `parent`, as vLLM lists them)."""

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


def _model_card(name: str, created: int, parent: str | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "paged_llm"}
    if parent is not None:
        card["parent"] = parent
    return card


async def _cards(request: Request) -> dict[str, dict[str, Any]]:
    """Model cards by id: the ready models, then the adapters of those."""
    created = int(time.time())
    ready = await _ready_models(request)
    cards = {name: _model_card(name, created) for name in ready}
    settings = app_state(request).settings
    if settings.allow_runtime_lora_updates and settings.health_model in cards:
        try:  # what the engine serves now (any worker may have loaded or unloaded one)
            names = await app_state(request).triton.lora_admin(settings.health_model, {"action": "list"})
        except OpenAIError as error:
            logger.warning("listing the LoRA adapters of %s failed: %s", settings.health_model, error)
        else:
            for stale in [
                n for n, parent in settings.lora_adapters.items() if parent == settings.health_model
            ]:
                settings.lora_adapters.pop(stale)
            settings.lora_adapters.update(dict.fromkeys(names, settings.health_model))
    for adapter, parent in settings.lora_adapters.items():
        if parent in cards and adapter not in cards:
            cards[adapter] = _model_card(adapter, created, parent)
    return cards


async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": list((await _cards(request)).values())}


async def model(model: str, request: Request) -> dict[str, Any]:
    card = (await _cards(request)).get(model)
    if card is None:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return card
