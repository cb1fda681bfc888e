"""One gRPC stream per request to a Triton model with vllm_backend's request interface (API.md).

Our `llm` model is asked (request parameter `paged_llm_error_output`) to send its errors as an
ordinary final response holding `paged_llm_error` = "<label>\\t<message>": over a gRPC stream Triton
2.51 passes only an error's message, and the HTTP status depends on its code. Other models' errors
arrive as messages and are classified by their text.

Closing the async generator before the final response (the HTTP client went away) cancels the gRPC
call; Triton then reports the request cancelled to the model, which aborts it and frees its KV.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paged_llm.frontend.errors import OpenAIError

logger = logging.getLogger(__name__)
ERROR_OUTPUT = "paged_llm_error"
ERROR_OUTPUT_PARAMETER = "paged_llm_error_output"
# `paged_llm_error` labels (as in paged_llm_final_responses_total) -> HTTP status.
_STATUS_OF_LABEL = {
    "invalid_arg": 400,
    "not_found": 404,
    "unavailable": 503,
    "cancelled": 503,
    "internal": 500,
}


@dataclass
class GenerationRequest:
    model: str
    prompt: str | list[int]  # text, or token ids
    sampling_parameters: dict[str, Any]
    stream: bool  # one response per engine step (else one at the end)
    want_logprobs: bool
    request_id: str


@dataclass
class SequenceDelta:
    """What one response adds to sample `index`."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: (
        list[dict[str, dict[str, Any]]] | None
    )  # per position: {token_id: {logprob, rank, decoded_token}}
    finish_reason: str | None


@dataclass
class GenerationChunk:
    sequences: list[SequenceDelta] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    is_final: bool = False


class BackendError(OpenAIError):
    """The model refused or failed the request."""


def classify_error_message(message: str) -> BackendError:
    """A model's error that came as a message only (not from our llm model)."""
    lowered = message.lower()
    if "unknown model" in lowered or "is not found" in lowered:
        return BackendError(404, message, "model", "model_not_found")
    if "unavailable" in lowered or "queue is full" in lowered or "retry later" in lowered:
        return BackendError(503, message)
    if "invalid" in lowered or "unexpected inference input" in lowered:
        return BackendError(400, message)
    return BackendError(500, message)


def error_from_output(array: np.ndarray) -> BackendError:
    item = array.reshape(-1)[0]
    text = item.decode(errors="replace") if isinstance(item, bytes) else str(item)
    label, _, message = text.partition("\t")
    status = _STATUS_OF_LABEL.get(label, 500)
    param = message.split(": ", 1)[0] if status == 400 and ": " in message else None
    return BackendError(status, message, _openai_param(param))


def _openai_param(engine_field: str | None) -> str | None:
    """The engine names sampling_parameters keys or the prompt input; say what the client sent."""
    if engine_field in (None, "text_input", "input_ids"):
        return "prompt" if engine_field else None
    if engine_field.startswith("sampling_parameters."):
        return engine_field.split(".", 1)[1]
    return engine_field


def _tensor(name: str, array: np.ndarray, datatype: str) -> Any:
    import tritonclient.grpc.aio as grpcclient

    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def build_inputs(request: GenerationRequest) -> list[Any]:
    if isinstance(request.prompt, str):
        inputs = [_tensor("text_input", np.array([request.prompt.encode()], dtype=np.object_), "BYTES")]
    else:
        inputs = [_tensor("input_ids", np.asarray(request.prompt, dtype=np.int32), "INT32")]
    sampling = json.dumps(request.sampling_parameters).encode()
    inputs.append(_tensor("sampling_parameters", np.array([sampling], dtype=np.object_), "BYTES"))
    flags = {
        "stream": request.stream,
        "exclude_input_in_output": True,  # echo is ours to do
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_logprobs": request.want_logprobs,
    }
    for name, value in flags.items():
        inputs.append(_tensor(name, np.array([value], dtype=bool), "BOOL"))
    return inputs


def _strings(result: Any, name: str) -> list[str] | None:
    array = result.as_numpy(name)
    if array is None:
        return None
    return [
        v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)
    ]


def parse_result(result: Any, is_final: bool) -> GenerationChunk:
    """One Triton response -> a chunk (text, ids split per sample by num_output_tokens)."""
    texts = _strings(result, "text_output") or []
    counts_array = result.as_numpy("num_output_tokens")
    ids_array = result.as_numpy("output_ids")
    ids = [int(t) for t in ids_array.reshape(-1)] if ids_array is not None else []
    counts = [int(c) for c in counts_array.reshape(-1)] if counts_array is not None else [len(ids)]
    reasons = _strings(result, "finish_reason") if is_final else None
    logprobs = _strings(result, "logprobs")
    num_input = result.as_numpy("num_input_tokens")
    chunk = GenerationChunk(
        num_prompt_tokens=int(num_input.reshape(-1)[0]) if num_input is not None else None, is_final=is_final
    )
    offset = 0
    for index, text in enumerate(texts):
        count = counts[index] if index < len(counts) else 0
        positions = json.loads(logprobs[index]) if logprobs and index < len(logprobs) else None
        reason = reasons[index] if reasons and index < len(reasons) else None
        chunk.sequences.append(
            SequenceDelta(
                index=index,
                text=text,
                token_ids=ids[offset : offset + count],
                logprobs=positions,
                finish_reason=None if reason in (None, "None") else reason,
            )
        )
        offset += count
    return chunk


class TritonBackend:
    """The Triton server behind the OpenAI routes (one aio gRPC client, many streams)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.url = url
        self._client = grpcclient.InferenceServerClient(url)

    async def close(self) -> None:
        await self._client.close()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The model's responses as chunks, the last one `is_final`; BackendError on failure."""
        from tritonclient.utils import InferenceServerException

        triton_request = {
            "model_name": request.model,
            "inputs": build_inputs(request),
            "request_id": request.request_id,
            "enable_empty_final_response": True,
            "parameters": {ERROR_OUTPUT_PARAMETER: True},
        }

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield triton_request

        try:
            responses = self._client.stream_infer(requests())
        except InferenceServerException as error:
            raise BackendError(503, f"cannot reach tritonserver at {self.url}: {error.message()}") from None
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True
                    raise classify_error_message(error.message())
                is_final = bool(result.get_response().parameters["triton_final_response"].bool_param)
                if result.as_numpy(ERROR_OUTPUT) is not None:
                    finished = True
                    raise error_from_output(result.as_numpy(ERROR_OUTPUT))
                chunk = parse_result(result, is_final)
                if is_final:
                    finished = True
                yield chunk
                if is_final:
                    return
            finished = True
            raise BackendError(500, "tritonserver closed the stream before the final response")
        except InferenceServerException as error:
            finished = True
            raise BackendError(503, f"tritonserver stream failed: {error.message()}") from None
        finally:
            if not finished:
                responses.cancel()  # the HTTP client went away: Triton cancels the request

    async def ready_models(self) -> list[str]:
        index = await self._client.get_model_repository_index(as_json=True)
        return sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})

    async def is_ready(self, model: str) -> bool:
        try:
            return bool(await self._client.is_server_ready(client_timeout=2.0)) and bool(
                await self._client.is_model_ready(model, client_timeout=2.0)
            )
        except Exception:
            return False

    async def server_version(self) -> str:
        metadata = await self._client.get_server_metadata(as_json=True, client_timeout=2.0)
        return str(metadata.get("version", ""))

    async def model_parameters(self, model: str) -> dict[str, str]:
        config = await self._client.get_model_config(model, as_json=True, client_timeout=5.0)
        parameters = config.get("config", config).get("parameters", {})
        return {k: v.get("string_value", "") for k, v in parameters.items()}
