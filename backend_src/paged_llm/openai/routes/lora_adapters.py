"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, with --allow-runtime-lora-updates):
the request goes to the model (triton_model/lora_admin.py), which reads the adapter in its engine
core; this worker then routes the adapter's name to that model (other workers try an unknown name
as an adapter of --health-model, and the engine says whether it serves it)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse

from paged_llm.openai.edge import read_body
from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse_body
from paged_llm.openai.state import app_state


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = app_state(request)
    body = parse_body(await read_body(request, state.settings.max_body_bytes), LoadLoRAAdapterRequest)
    model = body.model or state.settings.health_model
    await state.models.check(model)
    if body.lora_name in state.models.names or body.lora_name == state.settings.health_model:
        raise OpenAIError(400, f"lora_name: {body.lora_name!r} is the name of a served model", "lora_name")
    await state.triton.lora_admin(
        model, {"action": "load", "lora_name": body.lora_name, "lora_path": body.lora_path}
    )
    state.settings.lora_adapters[body.lora_name] = model
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = app_state(request)
    body = parse_body(await read_body(request, state.settings.max_body_bytes), UnloadLoRAAdapterRequest)
    model = body.model or state.settings.lora_adapters.get(body.lora_name) or state.settings.health_model
    await state.models.check(model)
    try:
        await state.triton.lora_admin(model, {"action": "unload", "lora_name": body.lora_name})
    except OpenAIError as error:
        if error.status_code == 400 and "is not loaded" in error.message:  # (vLLM: 404)
            raise OpenAIError(404, error.message, "lora_name", "not_found") from None
        raise
    state.settings.lora_adapters.pop(body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
