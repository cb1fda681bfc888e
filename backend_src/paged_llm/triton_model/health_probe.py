"""The OpenAI server's /health probe of the llm model, answered from the stub's own state.

A request carrying the parameter HEALTH_PROBE_PARAMETER is never parsed, tokenized, counted in the
request metrics or sent to the engine: it gets one FINAL response at once, empty while the engine
serves (its core up, this stub not stopping), or UNAVAILABLE with the reason while it does not
(the core died and is being restarted, gave up, or the model is shutting down). A dead stub is
refused by Triton itself ("Stub process ... is not healthy"), so every state has its answer.
"""

from __future__ import annotations

import logging
from typing import Any

from paged_llm.errors import EngineDeadError, wire_text
from paged_llm.triton_model.triton_codec import FORWARDED_ERROR_OUTPUT, encode_forwarded_error

HEALTH_PROBE_PARAMETER = "paged_llm_health_probe"
logger = logging.getLogger(__name__)


def answer_health_probe(pb_utils: Any, sender: Any, check_serving: Any, errors_as_output: bool) -> None:
    """`check_serving()` raises EngineDeadError while the engine does not serve (AsyncLLM's
    check_accepting)."""
    try:
        check_serving()
        response = pb_utils.InferenceResponse(output_tensors=[])
    except EngineDeadError as error:
        if errors_as_output:
            tensor = pb_utils.Tensor(
                FORWARDED_ERROR_OUTPUT, encode_forwarded_error("unavailable", str(error))
            )
            response = pb_utils.InferenceResponse(output_tensors=[tensor])
        else:
            triton_error = pb_utils.TritonError(wire_text(str(error)), pb_utils.TritonError.UNAVAILABLE)
            response = pb_utils.InferenceResponse(error=triton_error)
    try:
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as send_error:  # the prober may be gone already
        logger.info("could not answer a health probe: %s", send_error)
