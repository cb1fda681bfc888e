"""TensorRT-LLM-style front door (BLS): converts each request, forwards it to `llm`, converts back.

One thread per in-flight request iterates the `llm` responses (BLS `exec(decoupled=True)` blocks) and
sends the converted ones through this request's sender; the FINAL flag is passed through once.
"""

from __future__ import annotations

import threading
from typing import Any

import triton_python_backend_utils as pb_utils

from paged_llm.errors import InvalidRequestError
from paged_llm.serving.triton_codec import read_inputs
from paged_llm.serving.trtllm_codec import (
    INPUT_NAMES,
    TrtllmResponseState,
    check_request_parameters,
    to_llm_request,
)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_LLM_OUTPUTS = [
    "text_output",
    "output_ids",
    "num_input_tokens",
    "num_output_tokens",
    "cumulative_logprob",
    "logprobs",
]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                check_request_parameters(request.parameters())
                inputs = read_inputs(request, INPUT_NAMES, pb_utils.get_input_tensor_by_name)
                forward = to_llm_request(inputs)
            except InvalidRequestError as error:
                error_response = pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error_response), flags=_FINAL)
                continue
            thread = threading.Thread(target=self._forward, args=(request, sender, forward), daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def _forward(self, request: Any, sender: Any, forward: Any) -> None:
        """Streaming: each llm response is forwarded at once and an empty FINAL closes the stream.
        Non-streaming: llm sends one response; it goes out together with the FINAL flag."""
        try:
            state = TrtllmResponseState(forward)
            inner = pb_utils.InferenceRequest(
                model_name="llm",
                inputs=[pb_utils.Tensor(name, array) for name, array in forward.inputs.items()],
                requested_output_names=_LLM_OUTPUTS,
                timeout=request.timeout(),
            )
            held: Any = None  # non-streaming: the converted response waiting for the FINAL flag
            for response in inner.exec(decoupled=True):
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()), flags=_FINAL)
                    return
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if not outputs:
                    continue  # the empty final response of the llm stream
                converted = state.convert(outputs)
                reply = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(n, a) for n, a in converted.items()]
                )
                if forward.stream:
                    sender.send(reply)
                else:
                    held = reply
            if held is not None:
                sender.send(held, flags=_FINAL)
            else:
                sender.send(flags=_FINAL)
        except Exception as error:  # never leave the client without a final response
            pb_utils.Logger.log_error(f"llm_trtllm: forwarding failed: {error!r}")
            try:
                internal = pb_utils.TritonError(f"llm_trtllm: {error}", pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=internal), flags=_FINAL)
            except Exception:
                pass
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def finalize(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10.0)
