"""TensorRT-LLM-style front door (BLS): converts each request, forwards it to `llm`, converts back.

The models `llm_trtllm`, `ensemble` and `tensorrt_llm_bls` of the model repository all run this class
(their model.py imports it); their config.pbtxt picks the response layout (`response_layout`:
`tensorrt_llm` or `ensemble`, see triton_model/trtllm_codec.py).

One thread per in-flight request iterates the `llm` responses (BLS `exec(decoupled=True)` blocks) and
sends the converted ones through this request's sender; the FINAL flag is passed through once.

Errors: Triton 2.51's BLS loses an error response that follows data responses (the iterator then
waits forever), so llm sends a forwarded request's error as an ordinary FINAL holding only the
`paged_llm_error` output, turned back into the error here.

Cancellation: Triton 2.51's BLS cannot cancel a request it sent (the response iterator's cancel()
came in a later release), so a watcher thread asks each in-flight request's `is_cancelled()`
(a cancelled gRPC stream, a `generate_stream` client that went away) and, when it is, sends `llm`
a second request naming the forwarded one (triton_model/triton_codec.py: FORWARDED_ABORT_PARAMETER);
`llm` ends it with CANCELLED, which comes back through the forwarding thread.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import triton_python_backend_utils as pb_utils

from paged_llm.errors import InvalidRequestError, wire_text
from paged_llm.triton_model.triton_codec import (
    FORWARDED_ABORT_PARAMETER,
    FORWARDED_ERROR_OUTPUT,
    FORWARDED_REQUEST_ID_PREFIX,
    authorization_of,
    decode_forwarded_error,
    read_inputs,
)
from paged_llm.triton_model.trtllm_codec import (
    INPUT_NAMES,
    LAYOUTS,
    TrtllmResponseState,
    check_request_parameters,
    client_error_text,
    split_batch,
    to_llm_request,
)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# labels of llm's forwarded errors -> TritonError code names (pb_utils.TritonError exists only
# once the stub runs a model, not when it imports this file to auto-complete the config)
_ERROR_CODE_NAMES = {"invalid_arg": "INVALID_ARG", "unavailable": "UNAVAILABLE", "cancelled": "CANCELLED"}
_CANCEL_POLL_INTERVAL_S = 0.1
_ABORT_RETRY_S = 1.0
_LLM_OUTPUTS = [
    FORWARDED_ERROR_OUTPUT,
    "text_output",
    "output_ids",
    "num_input_tokens",
    "num_output_tokens",
    "cumulative_logprob",
    "logprobs",
]


def _authorization(request: Any) -> dict[str, str]:
    """The client's forwarded `authorization` header, passed on to llm, which checks API keys."""
    authorization = authorization_of(request.parameters())
    return {"authorization": authorization} if authorization else {}


class _ClientRequest:
    """A client's request: one llm request per row of its batch, one response sender."""

    def __init__(self, request: Any, sender: Any, num_rows: int) -> None:
        self.request = request
        self.sender = sender
        self.rows_left = num_rows
        self.done = False  # its FINAL went out: nothing more may be sent
        self.lock = threading.Lock()
        self.forwarded_ids: list[str] = []  # appended under the model's lock


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self._layout = parameters.get("response_layout", {}).get("string_value", "tensorrt_llm")
        if self._layout not in LAYOUTS:
            raise ValueError(
                f"{args['model_name']}: response_layout must be one of {', '.join(LAYOUTS)}, "
                f"got {self._layout!r}"
            )
        self._name = args["model_name"]
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        # forwarded id -> the client's request, while its FINAL has not gone out (is_cancelled() on
        # a request after its FINAL crashes tritonserver 2.51: only asked under this lock)
        self._in_flight: dict[str, Any] = {}
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="trtllm-cancel", daemon=True)
        self._watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                check_request_parameters(request.parameters())
                inputs = read_inputs(request, INPUT_NAMES, pb_utils.get_input_tensor_by_name)
                forwards = [to_llm_request(row) for row in split_batch(inputs)]
            except InvalidRequestError as error:
                error_response = pb_utils.TritonError(wire_text(str(error)), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error_response), flags=_FINAL)
                continue
            except Exception as error:  # a bug of ours: INTERNAL, one line to the client
                pb_utils.Logger.log_error(f"{self._name}: reading a request failed: {error!r}")
                message = f"{self._name}: internal error reading the request (the server log says why)"
                error_response = pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=error_response), flags=_FINAL)
                continue
            client = _ClientRequest(request, sender, len(forwards))
            for batch_index, forward in enumerate(forwards):
                thread = threading.Thread(
                    target=self._forward, args=(client, batch_index, forward), daemon=True
                )
                with self._lock:
                    self._threads.add(thread)
                thread.start()
        return None

    def _forward(self, client: _ClientRequest, batch_index: int, forward: Any) -> None:
        """One row of the client's batch, as its own llm request. Streaming: each llm response is
        forwarded at once. Non-streaming: llm sends one response per row. The last row to end sends
        the FINAL flag (with its data when not streaming, as HTTP generate needs)."""
        forwarded_id = f"{FORWARDED_REQUEST_ID_PREFIX}{uuid.uuid4().hex}"
        try:
            state = TrtllmResponseState(forward, self._layout, batch_index)
            inner = pb_utils.InferenceRequest(
                model_name="llm",
                inputs=[pb_utils.Tensor(name, array) for name, array in forward.inputs.items()],
                requested_output_names=_LLM_OUTPUTS,
                timeout=client.request.timeout(),
                request_id=forwarded_id,
                parameters=_authorization(client.request),  # llm checks the API key (triton_model/auth.py)
            )
            with client.lock:
                if client.done:  # another row failed before this one started
                    return
                with self._lock:
                    self._in_flight[forwarded_id] = client.request
                    client.forwarded_ids.append(forwarded_id)
            held: Any = None  # non-streaming: the row's converted response
            for response in inner.exec(decoupled=True):
                if response.has_error():
                    self._fail(client, response.error(), forwarded_id)
                    return
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if FORWARDED_ERROR_OUTPUT in outputs:  # llm's error, as data (see the docstring)
                    label, message = decode_forwarded_error(outputs[FORWARDED_ERROR_OUTPUT])
                    message = client_error_text(forward, message)
                    code = getattr(pb_utils.TritonError, _ERROR_CODE_NAMES.get(label, "INTERNAL"))
                    self._fail(client, pb_utils.TritonError(wire_text(message), code), forwarded_id)
                    return
                if not outputs:
                    continue  # the empty final response of the llm stream
                converted = state.convert(outputs)
                reply = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(n, a) for n, a in converted.items()]
                )
                if forward.stream:
                    with client.lock:
                        if not client.done:
                            client.sender.send(reply)
                else:
                    held = reply
            self._row_done(client, held)
        except Exception as error:  # never leave the client without a final response
            pb_utils.Logger.log_error(f"{self._name}: forwarding failed: {error!r}")
            try:
                message = wire_text(f"{self._name}: {error}")
                internal = pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
                self._fail(client, internal, forwarded_id)
            except Exception:
                pass
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                self._in_flight.pop(forwarded_id, None)

    def _row_done(self, client: _ClientRequest, held: Any | None) -> None:
        with client.lock:
            if client.done:
                return
            client.rows_left -= 1
            if client.rows_left > 0:
                if held is not None:
                    client.sender.send(held)
                return
            client.done = True
            self._forget(client)
            if held is None:
                client.sender.send(flags=_FINAL)
            else:
                client.sender.send(held, flags=_FINAL)

    def _fail(self, client: _ClientRequest, error: Any, failed_id: str) -> None:
        """The request's one error FINAL (the first row to fail sends it); the other rows' llm
        requests are ended."""
        with client.lock:
            if client.done:
                return
            client.done = True
            self._forget(client)
            client.sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
            others = [i for i in client.forwarded_ids if i != failed_id]
        authorization = _authorization(client.request) if others else {}
        for forwarded_id in others:
            self._abort_forwarded(forwarded_id, authorization)

    def _forget(self, client: _ClientRequest) -> None:
        """No is_cancelled() on the client's request once its FINAL goes out (caller holds client.lock)."""
        with self._lock:
            for forwarded_id in client.forwarded_ids:
                self._in_flight.pop(forwarded_id, None)

    def _watch_cancellations(self) -> None:
        """Forwards each cancellation to llm; again after a second if the request is still in flight
        (the abort may have reached llm before the request itself, e.g. while it was tokenized)."""
        aborted_at: dict[str, float] = {}
        while not self._stopping.wait(_CANCEL_POLL_INTERVAL_S):
            now = time.monotonic()
            cancelled = []
            with self._lock:
                for forwarded_id, request in self._in_flight.items():
                    if now - aborted_at.get(forwarded_id, -_ABORT_RETRY_S) < _ABORT_RETRY_S:
                        continue
                    if request.is_cancelled():
                        cancelled.append((forwarded_id, _authorization(request)))
                aborted_at = {k: v for k, v in aborted_at.items() if k in self._in_flight}
            for forwarded_id, authorization in cancelled:
                aborted_at[forwarded_id] = now
                self._abort_forwarded(forwarded_id, authorization)

    @staticmethod
    def _abort_forwarded(forwarded_id: str, authorization: dict[str, str]) -> None:
        abort = pb_utils.InferenceRequest(
            model_name="llm",
            inputs=[],
            requested_output_names=[],
            parameters={FORWARDED_ABORT_PARAMETER: forwarded_id, **authorization},
        )
        try:
            for _ in abort.exec(decoupled=True):  # one empty FINAL
                pass
        except Exception as error:
            pb_utils.Logger.log_warn(f"paged_llm BLS: could not forward a cancellation: {error!r}")

    def finalize(self) -> None:
        self._stopping.set()
        self._watcher.join(timeout=5.0)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10.0)
