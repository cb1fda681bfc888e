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
from paged_llm.errors import EngineDeadError, InvalidRequestError, QueueFullError
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.serving.triton_codec import INPUT_NAMES, ResponseAccumulator, parse_request

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_POLL_INTERVAL_S = 0.02  # how often the response thread wakes without outputs (cancellation polls)


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


def _error_code(error: BaseException) -> Any:
    if isinstance(error, InvalidRequestError):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(error, QueueFullError | EngineDeadError):
        return pb_utils.TritonError.UNAVAILABLE
    return pb_utils.TritonError.INTERNAL


@dataclass
class _Stream:
    """One in-flight Triton request."""

    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    accumulator: ResponseAccumulator


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
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
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

    @staticmethod
    def _send_error(sender: Any, error: BaseException) -> None:
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), _error_code(error)))
        try:
            sender.send(response, flags=_FINAL)
        except Exception as send_error:  # the client may be gone already
            logging.getLogger("paged_llm").warning("could not send an error response: %s", send_error)

    # ----------------------------------------------------------------------------- response thread
    def _respond_loop(self) -> None:
        while True:
            try:
                first = self._outputs.get(timeout=_POLL_INTERVAL_S)
            except queue.Empty:
                if self._stopping.is_set() and not self._streams:
                    return
                continue
            touched: dict[str, _Stream] = {}
            output: RequestOutput | None = first
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

    def _send(self, stream: _Stream) -> None:
        accumulator = stream.accumulator
        if accumulator.finished and accumulator.error is not None:
            self._forget(stream)
            self._send_error(stream.sender, accumulator.error)
            return
        tensors = accumulator.take()
        if tensors is None:
            return
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()]
        )
        if accumulator.finished:
            self._forget(stream)
        try:
            stream.sender.send(response, flags=_FINAL if accumulator.finished else 0)
        except Exception as error:  # the client went away: stop generating for it
            logging.getLogger("paged_llm").warning(
                "request %s: send failed (%s); aborting", stream.request_id, error
            )
            if not accumulator.finished:
                self._forget(stream)
                self.loop.abort(stream.request_id)

    def _forget(self, stream: _Stream) -> None:
        with self._streams_lock:
            self._streams.pop(stream.request_id, None)

    # ---------------------------------------------------------------------------------- shutdown
    def finalize(self) -> None:
        self.loop.shutdown(grace_s=5.0)
        self._stopping.set()
        self._response_thread.join(timeout=10.0)
