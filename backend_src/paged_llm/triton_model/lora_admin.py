"""LoRA adapters loaded and unloaded while serving, asked of the llm model by the OpenAI server
(vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter, and /v1/models' adapter cards).

A request carrying the parameter LORA_ADMIN_PARAMETER (a JSON object: `action` load | unload |
list, `lora_name`, `lora_path`) is never tokenized, counted or sent to the engine as a request:
the engine core is asked between two steps (on a thread of its own: reading an adapter takes a
while), and one FINAL response carries `text_output` = {"lora_names": [the adapters now]} or the
error (INVALID_ARG naming the field: the core refused the adapter, or the model does not allow
updates while serving). The model's API key check applies before."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np

from paged_llm.errors import EngineDeadError, InvalidRequestError

LORA_ADMIN_PARAMETER = "paged_llm_lora_admin"
# action -> the AsyncLLM method (each a utility call of the engine core of the same name)
ACTIONS = {"load": "load_lora_adapter", "unload": "unload_lora_adapter", "list": "lora_adapter_names"}
logger = logging.getLogger(__name__)


def parse_lora_admin(raw: Any) -> tuple[str, tuple[str, ...]]:
    """(the AsyncLLM method, its arguments) of the parameter's JSON text."""
    try:
        command = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise InvalidRequestError(LORA_ADMIN_PARAMETER, "not JSON") from None
    if not isinstance(command, dict) or command.get("action") not in ACTIONS:
        raise InvalidRequestError(
            LORA_ADMIN_PARAMETER, f"expected an object with action one of {sorted(ACTIONS)}"
        )
    action = command["action"]
    fields = {"load": ("lora_name", "lora_path"), "unload": ("lora_name",), "list": ()}[action]
    args = []
    for field in fields:
        value = command.get(field)
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(field, "required (a non-empty string)")
        args.append(value)
    return ACTIONS[action], tuple(args)


def answer_lora_admin(
    streams: Any, pb_utils: Any, sender: Any, engine: Any, raw: Any, as_output: bool
) -> None:
    """Answers on a thread of its own; `streams.send_error` sends a refusal."""

    def run() -> None:
        try:
            name, args = parse_lora_admin(raw)
            names = getattr(engine, name)(*args)
            text = json.dumps({"lora_names": list(names)})
            tensor = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
            response = pb_utils.InferenceResponse(output_tensors=[tensor])
        except (InvalidRequestError, EngineDeadError) as error:
            streams.send_error(sender, error, as_output)
            return
        except Exception as error:  # a bug of ours
            logger.exception("a LoRA admin request failed")
            streams.send_error(sender, RuntimeError(f"internal error: {type(error).__name__}"), as_output)
            return
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as send_error:  # the client may be gone
            logger.info("could not answer a LoRA admin request: %s", send_error)

    threading.Thread(target=run, name="paged_llm-lora-admin", daemon=True).start()
