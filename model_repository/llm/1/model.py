"""Triton adapter for the paged_llm engine (decoupled Python backend).

Thin on purpose: `execute()` parses and validates each request (errors answered at once), then hands
it to the engine thread and returns. A response thread turns engine outputs into responses, merging
whatever piled up for a request since its last send, and sets the FINAL flag exactly once.
Everything that is not Triton glue lives in the `paged_llm` package.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from paged_llm.config import EngineConfig
from paged_llm.engine.engine_loop import EngineLoop
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.engine.outputs import RequestOutput
from paged_llm.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestAbortedError
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.serving.metrics import TritonMetrics
from paged_llm.serving.triton_codec import INPUT_NAMES, ResponseAccumulator, parse_request, read_inputs

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_WAKE_INTERVAL_S = 0.02  # the response thread wakes at least this often
_CANCEL_POLL_INTERVAL_S = 0.05  # how often in-flight requests are asked whether they were cancelled
_METRICS_INTERVAL_S = 0.5
_SHUTDOWN_GRACE_S = 5.0  # finalize(): in-flight requests get this long, then they are cancelled


class _TritonLogHandler(logging.Handler):
    """Routes the package's `logging` records into Triton's log."""

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


def _error_code(error: BaseException) -> tuple[Any, str]:
    """Triton status code for an error, and its label in paged_llm_final_responses_total."""
    if isinstance(error, InvalidRequestError):
        return pb_utils.TritonError.INVALID_ARG, "invalid_arg"
    if isinstance(error, QueueFullError | EngineDeadError):
        return pb_utils.TritonError.UNAVAILABLE, "unavailable"
    if isinstance(error, RequestAbortedError):
        return pb_utils.TritonError.CANCELLED, "cancelled"
    return pb_utils.TritonError.INTERNAL, "internal"


@dataclass
class _Stream:
    """One in-flight Triton request."""

    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    accumulator: ResponseAccumulator
    cancelled: bool = False  # the client cancelled: no more data, one CANCELLED final


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        package_logger = logging.getLogger("paged_llm")
        if not package_logger.handlers:
            package_logger.addHandler(_TritonLogHandler())
            package_logger.setLevel(logging.INFO)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "the llm model must set model_transaction_policy { decoupled: true }"
            )
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = EngineConfig.from_parameters(parameters)
        model_dir = resolve_model_dir(config.model.model, Path(args["model_repository"]))
        config = replace(config, model=replace(config.model, model=str(model_dir)))
        self.engine = LLMEngine(config, show_progress=False)
        self.metrics = TritonMetrics(pb_utils, self.engine.stats, args["model_name"], args["model_version"])
        self.loop = EngineLoop(self.engine)
        self.loop.start()
        self._ids = itertools.count()
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stopping = threading.Event()
        self._response_thread = threading.Thread(
            target=self._respond_loop, name="paged_llm-responses", daemon=True
        )
        self._response_thread.start()

    # ------------------------------------------------------------------------------ Triton threads
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._accept(request)
        return None

    def _accept(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            inputs = read_inputs(request, INPUT_NAMES, pb_utils.get_input_tensor_by_name)
            parsed = parse_request(inputs, request.parameters(), self.engine.config.limits)
            if parsed.prompt_token_ids is not None:
                prompt_ids = parsed.prompt_token_ids
            else:
                prompt_ids = self.engine.tokenize(parsed.prompt_text or "")
            self.engine.validate_prompt(prompt_ids)
            self.engine.validate_params(parsed.params)
        except InvalidRequestError as error:
            self._send_error(sender, error)
            return
        if request.is_cancelled():
            self._send_error(sender, RequestAbortedError("cancelled by the client before it was queued"))
            return
        prompt_text = parsed.prompt_text
        if prompt_text is None:
            echo = not parsed.stream and not parsed.exclude_input_in_output
            prompt_text = self.engine.tokenizer.decode(prompt_ids) if echo else ""
        request_id = f"{next(self._ids)}"
        stream = _Stream(request_id, sender, ResponseAccumulator(parsed, prompt_text, len(prompt_ids)))
        timeout_us = request.timeout()
        deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
        with self._streams_lock:
            self._streams[request_id] = stream
        try:
            self.loop.submit(request_id, prompt_ids, parsed.params, self._outputs.put, deadline)
        except EngineDeadError as error:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            self._send_error(sender, error)

    def _send_error(self, sender: Any, error: BaseException) -> None:
        code, label = _error_code(error)
        self.metrics.count_final(label)
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), code))
        try:
            sender.send(response, flags=_FINAL)
        except Exception as send_error:  # the client may be gone already
            logging.getLogger("paged_llm").info("could not send an error response: %s", send_error)

    # ----------------------------------------------------------------------------- response thread
    def _respond_loop(self) -> None:
        next_cancel_poll = next_metrics = time.monotonic()
        while True:
            try:
                first: RequestOutput | None = self._outputs.get(timeout=_WAKE_INTERVAL_S)
            except queue.Empty:
                first = None
            touched: dict[str, _Stream] = {}
            output = first
            while output is not None:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.accumulator.add(output)
                    touched[output.request_id] = stream
                try:
                    output = self._outputs.get_nowait()
                except queue.Empty:
                    output = None
            for stream in touched.values():
                self._send(stream)
            now = time.monotonic()
            if now >= next_cancel_poll:
                self._poll_cancellations()
                next_cancel_poll = now + _CANCEL_POLL_INTERVAL_S
            if now >= next_metrics:
                self.metrics.update()
                next_metrics = now + _METRICS_INTERVAL_S
            if first is None and self._stopping.is_set() and not self._streams:
                self.metrics.update()
                return

    def _poll_cancellations(self) -> None:
        with self._streams_lock:
            streams = [s for s in self._streams.values() if not s.cancelled]
        for stream in streams:
            try:
                cancelled = stream.sender.is_cancelled()
            except Exception:  # a sender that cannot answer belongs to a request Triton already dropped
                cancelled = True
            if cancelled:
                stream.cancelled = True
                self.loop.abort(stream.request_id, "cancelled by the client")

    def _send(self, stream: _Stream) -> None:
        accumulator = stream.accumulator
        if accumulator.finished and accumulator.error is not None:
            self._forget(stream)
            self._send_error(stream.sender, accumulator.error)
            return
        if stream.cancelled and not accumulator.finished:
            return  # the abort is on its way; its CANCELLED final is the next thing the client gets
        tensors = accumulator.take()
        if tensors is None:
            return
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()]
        )
        if accumulator.finished:
            self._forget(stream)
            if stream.cancelled:
                # Finished on its own before the abort landed: the client still asked to cancel.
                self._send_error(stream.sender, RequestAbortedError("cancelled by the client"))
                return
            self.metrics.count_final("success")
        try:
            stream.sender.send(response, flags=_FINAL if accumulator.finished else 0)
        except Exception as error:  # the client went away: stop generating for it
            logging.getLogger("paged_llm").info(
                "request %s: send failed (%s); aborting", stream.request_id, error
            )
            if not accumulator.finished:
                stream.cancelled = True
                self.loop.abort(stream.request_id, f"response could not be sent ({error})")

    def _forget(self, stream: _Stream) -> None:
        with self._streams_lock:
            self._streams.pop(stream.request_id, None)

    # ---------------------------------------------------------------------------------- shutdown
    def finalize(self) -> None:
        """Stops accepting work, gives in-flight requests a bounded grace period, cancels the rest
        (each gets its CANCELLED final), then joins the engine and response threads."""
        self.loop.shutdown(grace_s=_SHUTDOWN_GRACE_S)
        self._stopping.set()
        self._response_thread.join(timeout=10.0)
        logging.getLogger("paged_llm").info(
            "paged_llm finalized: engine thread alive=%s, response thread alive=%s",
            self.loop.is_alive,
            self._response_thread.is_alive(),
        )
