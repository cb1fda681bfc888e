"""Generation requests over Triton's gRPC ModelStreamInfer, one call per request on grpc.aio.

Each request's protobuf is built here directly from `request_inputs` (raw contents in Triton's
layout): per request, tritonclient's stream_infer adds InferInput objects, a request iterator and a
task of gRPC's to consume it, which at a wave of 64 requests delays the last one's first token. Its
responses are read straight from their raw contents for the same reason (InferResult.as_numpy per
output costs more than the rest of a chunk's work at thousands of responses per second).
Closing the generator before the final response cancels the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from paged_llm.openai.triton_request import (
    GenerationRequest,
    StreamRefused,
    TritonUnreachable,
    request_inputs,
)

_TRUE, _FALSE = b"\x01", b"\x00"
_UINT32 = struct.Struct("<I")
# While tritonserver is down, a gRPC channel retries its connection with exponential backoff, by
# default up to 120 s apart, and fails every call at once in between: after a restart the OpenAI
# server answered 503 for seconds (measured: 2.1 s after 10 s down), and would for up to two
# minutes after a long outage. Triton is a near peer: try again at least once a second. (Not
# grpc.min_reconnect_backoff_ms: despite its name that is the time one connection attempt may
# take, 20 s by default, which a slow network or a busy host may need.)
RECONNECT_BACKOFF_MAX_MS = 1000
RECONNECT_BACKOFF_INITIAL_MS = 250
# A request that finds the stream channel not connected waits this long for it before it is sent
# (and then fails at once if Triton is still not there): the first requests after Triton came back
# succeed instead of failing until the channel's next connection attempt (at most ~1.2 s away:
# the backoff above with gRPC's 20% jitter). Below the /health probe's PROBE_TIMEOUT_S.
RECONNECT_WAIT_S = 2.0


def channel_options() -> list[tuple[str, int]]:
    """The options of both gRPC channels to Triton: tritonclient's message limits and a short
    reconnection backoff."""
    import tritonclient.grpc.aio as grpcclient

    return [
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_INITIAL_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ]


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
    parameters: dict[str, bool | str] | None = None,
) -> Any:
    """The ModelInferRequest protobuf of one generation, as tritonclient's stream_infer would build
    it from InferInput objects, without its per-input objects and copies."""
    from tritonclient.grpc import service_pb2

    proto = service_pb2.ModelInferRequest(model_name=request.model, id=request.request_id)
    tensors, contents = proto.inputs, proto.raw_input_contents
    for name, value in request_inputs(request).items():
        if isinstance(value, bool):
            tensors.append(_flag_tensor(name))
            contents.append(_TRUE if value else _FALSE)
        elif isinstance(value, str):
            tensors.add(name=name, datatype="BYTES", shape=[1])
            contents.append(_bytes_element(value.encode()))
        else:
            ids = np.asarray(value, dtype=np.int32)
            tensors.add(name=name, datatype="INT32", shape=[len(ids)])
            contents.append(ids.tobytes())
    for name in outputs or ():
        proto.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        if isinstance(value, str):  # (a LoRA admin request's command)
            proto.parameters[key].string_param = value
        else:
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
    """A ModelInferResponse's outputs as lists (str for BYTES, int or float otherwise), read
    straight from its raw contents."""
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


class GrpcStreams:
    """One aio gRPC channel to Triton for the generation streams (channel_options)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        from tritonclient.grpc import service_pb2_grpc

        self.url = url
        # Sent with each request: Triton forwards it to the model, which checks it when
        # `paged-llm serve --api-key` gave it a verifier of the keys (triton_model/auth.py).
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel = grpc.aio.insecure_channel(url, options=channel_options())
        self._stream_infer = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelStreamInfer

    async def close(self) -> None:
        await self._channel.close()

    async def responses(
        self, request: GenerationRequest, outputs: tuple[str, ...] | None, parameters: dict[str, bool | str]
    ) -> AsyncIterator[tuple[dict[str, list[Any]], bool]]:
        """(outputs, is_final) per response, up to the final one; StreamRefused, TritonUnreachable.
        Ends without a final response only when Triton closed the stream early."""
        proto = build_request(request, outputs, parameters)
        if self._channel.get_state() != grpc.ChannelConnectivity.READY:
            # (wait_for, not asyncio.timeout: the Docker image's Python is 3.10)
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self._channel.channel_ready(), RECONNECT_WAIT_S)
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
                    finished = True
                    return
                received = True
                if message.error_message:
                    finished = True
                    raise StreamRefused(message.error_message)
                response = message.infer_response
                is_final = bool(response.parameters["triton_final_response"].bool_param)
                finished = finished or is_final
                yield response_outputs(response), is_final
                if is_final:
                    return
        except grpc.RpcError as error:  # unreachable, the server went away mid-stream, or refused it
            finished = True
            detail = error.details() if hasattr(error, "details") else str(error)
            reached = received or error.code() != grpc.StatusCode.UNAVAILABLE
            raise TritonUnreachable(detail, reached) from None
        finally:
            if not finished:
                call.cancel()  # the HTTP client went away: Triton cancels the request
