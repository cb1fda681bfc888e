"""One Triton stream per request to a model with vllm_backend's request interface (API.md).

Streamed requests go over Triton's HTTP generate_stream when its HTTP endpoint is given
(triton_http.py: cheaper per response in Python); the others, and every request without it, over
gRPC. The gRPC streams are tritonclient's ModelStreamInfer calls on grpc.aio, each request's protobuf built
here directly: per request, tritonclient's stream_infer adds InferInput objects, a request iterator
and a task of gRPC's to consume it, which at a wave of 64 requests delays the last one's first token.

Our `llm` model is asked (request parameter `paged_llm_error_output`) to send its errors as an
ordinary final response holding `paged_llm_error` = "<label>\\t<message>": over a gRPC stream Triton
2.51 passes only an error's message, and the HTTP status depends on its code. Other models' errors
arrive as messages and are classified by their text.

Closing the async generator before the final response (the HTTP client went away) cancels the gRPC
call, or closes the HTTP connection; Triton then reports the request cancelled to the model, which
aborts it and frees its KV.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import struct
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from paged_llm.frontend.errors import OpenAIError
from paged_llm.frontend.triton_http import GenerateStreamError, GenerateStreams, TritonUnreachable

logger = logging.getLogger(__name__)
ERROR_OUTPUT = "paged_llm_error"
PROBE_SKIP_S = 5.0  # /health sends no probe when the model answered a request this recently
PROBE_TIMEOUT_S = 3.0  # below the usual 5 s of a readiness probe's own timeout
ERROR_OUTPUT_PARAMETER = "paged_llm_error_output"
# Streamed without logprobs, our llm model sends finish_reason and the token counts on the final
# response only (num_output_tokens then the request's total): the others carry text_output alone,
# which measurably lowers the stub's cost per response at high concurrency.
TOTALS_ON_FINAL_PARAMETER = "paged_llm_totals_on_final"
# `paged_llm_error` labels (as in paged_llm_final_responses_total) -> HTTP status.
_PAGED_LLM_OUTPUTS = ("text_output", "num_output_tokens", "finish_reason", "num_input_tokens", ERROR_OUTPUT)
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
    # A session's turn (X-Session-Id etc.): {"session_id": str, "session_start": bool, "session_end": bool}
    session: dict[str, Any] | None = None


@dataclass
class SequenceDelta:
    """What one response adds to sample `index`."""

    index: int
    text: str
    num_tokens: int  # new tokens of this sample in this response
    token_ids: list[int]  # their ids, when the model sent output_ids (empty otherwise)
    logprobs: (
        list[dict[str, dict[str, Any]]] | None
    )  # per position: {token_id: {logprob, rank, decoded_token}}
    finish_reason: str | None
    total_tokens: int | None = None  # the sample's tokens in all (paged_llm_totals_on_final's final)


@dataclass
class GenerationChunk:
    sequences: list[SequenceDelta] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    is_final: bool = False


class BackendError(OpenAIError):
    """The model refused or failed the request."""

    from_model: bool = False  # sent by our llm model itself (the error output), not by Triton


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


def error_from_output(values: list[str]) -> BackendError:
    label, _, message = values[0].partition("\t")
    status = _STATUS_OF_LABEL.get(label, 500)
    param = message.split(": ", 1)[0] if status == 400 and ": " in message else None
    error = BackendError(status, message, _openai_param(param))
    error.from_model = True
    return error


def _openai_param(engine_field: str | None) -> str | None:
    """The engine names sampling_parameters keys or the prompt input; say what the client sent."""
    if engine_field in (None, "text_input", "input_ids"):
        return "prompt" if engine_field else None
    if engine_field.startswith("sampling_parameters."):
        return engine_field.split(".", 1)[1]
    return engine_field


_TRUE, _FALSE = b"\x01", b"\x00"
_UINT32 = struct.Struct("<I")


@functools.cache
def _flag_tensor(name: str) -> Any:
    """A one-element BOOL input tensor's header, built once per name (a request's protobuf copies it in)."""
    from tritonclient.grpc import service_pb2

    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype="BOOL", shape=[1])


def _bytes_element(value: bytes) -> bytes:
    """One BYTES element in Triton's raw layout: a little-endian uint32 length, then the bytes."""
    return _UINT32.pack(len(value)) + value


def build_request(
    request: GenerationRequest,
    outputs: tuple[str, ...] | None = None,
    parameters: dict[str, bool] | None = None,
) -> Any:
    """The ModelInferRequest protobuf of one generation, as tritonclient's stream_infer would build
    it from InferInput objects (the inputs of API.md, raw contents in Triton's layout), without its
    per-input objects and copies."""
    from tritonclient.grpc import service_pb2

    proto = service_pb2.ModelInferRequest(model_name=request.model, id=request.request_id)
    tensors, contents = proto.inputs, proto.raw_input_contents
    if isinstance(request.prompt, str):
        tensors.add(name="text_input", datatype="BYTES", shape=[1])
        contents.append(_bytes_element(request.prompt.encode()))
    else:
        ids = np.asarray(request.prompt, dtype=np.int32)
        tensors.add(name="input_ids", datatype="INT32", shape=[len(ids)])
        contents.append(ids.tobytes())
    tensors.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    contents.append(_bytes_element(json.dumps(request.sampling_parameters).encode()))
    flags = {
        "stream": request.stream,
        "exclude_input_in_output": True,  # echo is ours to do
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_logprobs": request.want_logprobs,
    }
    if request.session is not None:
        tensors.add(name="session_id", datatype="BYTES", shape=[1])
        contents.append(_bytes_element(str(request.session["session_id"]).encode()))
        for name in ("session_start", "session_end"):
            flags[name] = bool(request.session.get(name))
    tensors.extend([_flag_tensor(name) for name in flags])
    contents.extend([_TRUE if value else _FALSE for value in flags.values()])
    for name in outputs or ():
        proto.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        proto.parameters[key].bool_param = value
    return proto


def _decode_bytes(raw: bytes) -> list[str]:
    """Triton's raw BYTES layout: per element a little-endian uint32 length, then the bytes."""
    items, offset, end = [], 0, len(raw)
    while offset < end:
        (length,) = _UINT32.unpack_from(raw, offset)
        offset += 4
        items.append(raw[offset : offset + length].decode("utf-8", errors="replace"))
        offset += length
    return items


def response_outputs(response: Any) -> dict[str, list[Any]]:
    """A ModelInferResponse's outputs as lists (str for BYTES, int otherwise), read straight from
    its raw contents: InferResult.as_numpy per output costs more than the rest of a chunk's work
    at thousands of responses per second."""
    outputs: dict[str, list[Any]] = {}
    raw_contents = response.raw_output_contents
    for index, tensor in enumerate(response.outputs):
        raw = raw_contents[index] if index < len(raw_contents) else b""
        if tensor.datatype == "BYTES":
            outputs[tensor.name] = _decode_bytes(raw)
        elif tensor.datatype in ("INT32", "UINT32"):
            code = "i" if tensor.datatype == "INT32" else "I"
            outputs[tensor.name] = list(struct.unpack(f"<{len(raw) // 4}{code}", raw))
        elif tensor.datatype == "FP32":
            outputs[tensor.name] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return outputs


def parse_outputs(
    outputs: dict[str, list[Any]], is_final: bool, totals_on_final: bool = False
) -> GenerationChunk:
    """One Triton response -> a chunk (text, ids split per sample by num_output_tokens).
    `totals_on_final`: the request set paged_llm_totals_on_final (no output_ids, no logprobs)."""
    texts = outputs.get("text_output", [])
    ids = outputs.get("output_ids", [])
    counts = outputs.get("num_output_tokens")
    totals = None
    if totals_on_final:
        totals, counts = counts, None
    if counts is None:
        counts = [len(ids)]
    reasons = outputs.get("finish_reason") if is_final else None
    logprobs = outputs.get("logprobs")
    num_input = outputs.get("num_input_tokens")
    chunk = GenerationChunk(num_prompt_tokens=num_input[0] if num_input else None, is_final=is_final)
    offset = 0
    for index, text in enumerate(texts):
        count = counts[index] if index < len(counts) else 0
        positions = json.loads(logprobs[index]) if logprobs and index < len(logprobs) else None
        reason = reasons[index] if reasons and index < len(reasons) else None
        chunk.sequences.append(
            SequenceDelta(
                index=index,
                text=text,
                num_tokens=count,
                token_ids=ids[offset : offset + count] if ids else [],
                logprobs=positions,
                finish_reason=None if reason in (None, "None") else reason,
                total_tokens=totals[index] if totals and index < len(totals) else None,
            )
        )
        offset += count
    return chunk


class TritonBackend:
    """The Triton server behind the OpenAI routes (one aio gRPC channel, one HTTP connection pool)."""

    def __init__(self, url: str, api_key: str | None = None, http_url: str | None = None) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.url = url
        # With Triton's HTTP endpoint given, streamed generation requests go there (triton_http.py
        # says why); the others, the model index, configs and readiness stay on gRPC.
        self._http = GenerateStreams(http_url, api_key) if http_url else None
        # Sent with each inference request: Triton forwards it to the model, which checks it when
        # `paged-llm serve --api-key` set the model's api_key_sha256 (serving/auth.py).
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._client = grpcclient.InferenceServerClient(url)
        # The generation streams go straight through tritonclient's service stub on a channel of
        # their own (same message limits as tritonclient's); the other calls use its client.
        from tritonclient.grpc import service_pb2_grpc

        self._channel = grpc.aio.insecure_channel(
            url,
            options=[
                ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ],
        )
        self._stream_infer = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelStreamInfer
        self._kind_cache: dict[str, tuple[bool, bool]] = {}
        self._last_answer_at: dict[str, float] = {}  # model -> when it last sent a response
        self._probes: dict[str, asyncio.Future[bool]] = {}  # model -> the /health probe in flight

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        await self._channel.close()
        await self._client.close()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The model's responses as chunks, the last one `is_final`; BackendError on failure."""
        parameters = {ERROR_OUTPUT_PARAMETER: True}
        outputs = None
        totals_on_final = False
        if await self._is_paged_llm(request.model):
            # Only what the routes read: the model then builds nothing else (no output_ids).
            outputs = (*_PAGED_LLM_OUTPUTS, *(("logprobs",) if request.want_logprobs else ()))
            totals_on_final = request.stream and not request.want_logprobs
            if totals_on_final:
                parameters[TOTALS_ON_FINAL_PARAMETER] = True
        if self._http is not None and request.stream:
            # (A request that is not streamed stays on gRPC: Triton 2.51's HTTP server notices a
            # client that left only when it writes to it, and such a request has nothing to write
            # until it ends, so its cancellation would come too late. Its one response makes the
            # cost per response moot.)
            responses = self._http_responses(request, outputs, parameters)
        else:
            responses = self._grpc_responses(request, outputs, parameters)
        async with aclosing(responses):
            async for outputs_of, is_final in responses:
                if ERROR_OUTPUT in outputs_of:
                    raise error_from_output(outputs_of[ERROR_OUTPUT])
                self._last_answer_at[request.model] = time.monotonic()
                yield parse_outputs(outputs_of, is_final, totals_on_final)

    async def _http_responses(
        self, request: GenerationRequest, outputs: tuple[str, ...] | None, parameters: dict[str, bool]
    ) -> AsyncIterator[tuple[dict[str, list[Any]], bool]]:
        """Over Triton's HTTP generate_stream (triton_http.py), read to the end of the body."""
        assert self._http is not None
        final_seen = False
        try:
            async for outputs_of, is_final in self._http.responses(request, outputs, parameters):
                final_seen = final_seen or is_final
                yield outputs_of, is_final
        except GenerateStreamError as error:
            raise classify_error_message(error.message) from None
        except TritonUnreachable as error:
            if not error.received:
                raise BackendError(503, f"cannot reach tritonserver at {self._http.url}: {error}") from None
            raise BackendError(503, f"tritonserver stream failed: {error}") from None
        if not final_seen and outputs is not None:  # our llm model always marks its last response
            raise BackendError(500, "tritonserver closed the stream before the final response")

    async def _grpc_responses(
        self, request: GenerationRequest, outputs: tuple[str, ...] | None, parameters: dict[str, bool]
    ) -> AsyncIterator[tuple[dict[str, list[Any]], bool]]:
        """Over a ModelStreamInfer call of its own, up to the final response."""
        proto = build_request(request, outputs, parameters)
        # The stream's one request is written and the writing side closed on this task: no request
        # iterator and no task of gRPC's to consume it (tritonclient's stream_infer has both).
        call = self._stream_infer(metadata=self._metadata)
        finished = received = False
        try:
            await call.write(proto)
            await call.done_writing()
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                received = True
                if message.error_message:
                    finished = True
                    raise classify_error_message(message.error_message)
                response = message.infer_response
                is_final = bool(response.parameters["triton_final_response"].bool_param)
                finished = finished or is_final
                yield response_outputs(response), is_final
                if is_final:
                    return
            finished = True
            raise BackendError(500, "tritonserver closed the stream before the final response")
        except grpc.RpcError as error:  # unreachable, the server went away mid-stream, or refused it
            finished = True
            detail = error.details() if hasattr(error, "details") else str(error)
            if error.code() == grpc.StatusCode.UNAVAILABLE and not received:
                raise BackendError(503, f"cannot reach tritonserver at {self.url}: {detail}") from None
            raise BackendError(503, f"tritonserver stream failed: {detail}") from None
        finally:
            if not finished:
                call.cancel()  # the HTTP client went away: Triton cancels the request

    async def _kind(self, model: str) -> tuple[bool, bool] | None:
        """(has vllm_backend's interface, is our llm model), from the model's config (cached), or
        None while the config cannot be read."""
        known = self._kind_cache.get(model)
        if known is None:
            try:
                config = await self._client.get_model_config(model, as_json=True, client_timeout=5.0)
            except Exception:
                return None  # unknown for now (the request itself will say why); ask again next time
            config = config.get("config", config)
            inputs = {i.get("name") for i in config.get("input", [])}
            outputs = {o.get("name") for o in config.get("output", [])}
            known = ("sampling_parameters" in inputs and "text_output" in outputs, ERROR_OUTPUT in outputs)
            self._kind_cache[model] = known
        return known

    async def _is_paged_llm(self, model: str) -> bool:
        """Whether `model` is our llm model (it has the error output); other vllm_backend-style
        models get no requested outputs (they send theirs), so a name they lack cannot fail them."""
        kind = await self._kind(model)
        return kind is not None and kind[1]

    async def ready_models(self) -> list[str]:
        """The ready models with vllm_backend's request interface (the ones these routes can send
        to; e.g. the TensorRT-LLM convention's models are left out)."""
        index = await self._client.get_model_repository_index(as_json=True, client_timeout=5.0)
        ready = sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})
        kinds = [await self._kind(name) for name in ready]
        return [name for name, kind in zip(ready, kinds, strict=True) if kind is None or kind[0]]

    async def is_ready(self, model: str) -> bool:
        """Triton and the model say ready, and the model answers. Triton 2.51 keeps calling a model
        ready after its Python stub died (every request then fails "Stub process ... is not
        healthy"), so unless a response came from it within the last PROBE_SKIP_S, a one-token
        request goes to it: an answer of any kind, an error the model itself sent included (e.g.
        its queue is full), or no answer within PROBE_TIMEOUT_S (queued behind work) means it is
        alive; Triton's "not healthy" error means not."""
        try:
            ready = bool(await self._client.is_server_ready(client_timeout=2.0)) and bool(
                await self._client.is_model_ready(model, client_timeout=2.0)
            )
        except Exception:
            return False
        if not ready:
            return False
        if time.monotonic() - self._last_answer_at.get(model, -PROBE_SKIP_S) < PROBE_SKIP_S:
            return True
        # One probe at a time per model, shared by every /health caller meanwhile.
        probe = self._probes.get(model)
        if probe is None or probe.done():
            probe = self._probes[model] = asyncio.ensure_future(self._probe(model))
        return await asyncio.shield(probe)

    async def _probe(self, model: str) -> bool:
        request = GenerationRequest(model, [0], {"max_tokens": 1}, False, False, "paged_llm-health-probe")

        async def drain() -> None:
            async for _chunk in self.generate(request):
                pass

        try:
            await asyncio.wait_for(drain(), PROBE_TIMEOUT_S)
        except BackendError as error:
            # Our llm model's own errors come as an output: it is alive. A message-only error is
            # Triton's (a dead stub) or another model's; only "not healthy" counts as dead there.
            return error.from_model or "not healthy" not in error.message
        except TimeoutError:
            # A dead stub is refused at once; a probe still waiting is queued behind real work.
            return True
        except Exception as error:
            logger.warning("health probe of %s failed: %s", model, error)
            return False
        return True

    async def server_version(self) -> str:
        metadata = await self._client.get_server_metadata(as_json=True, client_timeout=2.0)
        return str(metadata.get("version", ""))

    async def model_parameters(self, model: str) -> dict[str, str]:
        config = await self._client.get_model_config(model, as_json=True, client_timeout=5.0)
        parameters = config.get("config", config).get("parameters", {})
        return {k: v.get("string_value", "") for k, v in parameters.items()}
