"""Triton adapter for the paged_llm engine (decoupled Python backend).

Thin on purpose. This stub process is the front end only: `execute()` parses, tokenizes and
validates each request (errors answered at once) and hands it to AsyncLLM, whose engine core runs in
its own process (`engine_mode: process`, the default) and owns the device. AsyncLLM's output thread
detokenizes and calls `_on_outputs`, which sends one response per request per pass (one per engine
step while we keep up, merged steps when we fall behind) and sets the FINAL flag exactly once.
A housekeeping thread polls cancellation and refreshes metrics.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from paged_llm.config import EngineConfig
from paged_llm.engine.async_llm import AsyncLLM
from paged_llm.engine.outputs import RequestOutput
from paged_llm.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestAbortedError
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.serving.metrics import TritonMetrics
from paged_llm.serving.server_watch import ServerShutdownWatch, endpoint_of_process, exit_when_server_dies
from paged_llm.serving.triton_codec import INPUT_NAMES, ResponseAccumulator, parse_request, read_inputs

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_HOUSEKEEPING_INTERVAL_S = 0.05
_MIN_CANCEL_POLL_INTERVAL_S = 0.05  # each in-flight request is asked at most this often
_CANCEL_POLL_DUTY = 0.05  # cancellation polling may take at most this share of one thread's time
_METRICS_INTERVAL_S = 0.5
logger = logging.getLogger("paged_llm")


class _TritonLogHandler(logging.Handler):
    """Routes the package's `logging` records into Triton's log, or to stderr once the server is
    gone: a pb_utils.Logger call then blocks forever holding the GIL, and the stub cannot exit."""

    def __init__(self) -> None:
        super().__init__()
        self._server_pid = os.getppid()

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if os.getppid() != self._server_pid:
            print(f"paged_llm: {message}", file=sys.stderr, flush=True)
        elif record.levelno >= logging.ERROR:
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
    return pb_utils.TritonError.INTERNAL, "internal"  # EngineStepError (a model fault, a dead core)


@dataclass
class _Stream:
    """One in-flight Triton request. Its sender is used under `lock` only, and never once `closed`:
    Triton frees the request's response factory with the FINAL response, and an is_cancelled() on it
    after that crashes tritonserver (TRITONBACKEND_ResponseFactoryIsCancelled, seen with 2.51)."""

    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    accumulator: ResponseAccumulator
    cancelled: bool = False  # the client cancelled: no more data, one CANCELLED final
    closed: bool = False  # the FINAL response went out
    lock: threading.Lock = field(default_factory=threading.Lock)


def _ignore_ctrl_c() -> None:
    """Ctrl-C on `make serve` sends SIGINT to the whole process group. tritonserver handles it by
    unloading its models, which calls finalize(); a KeyboardInterrupt raised in this stub at the
    same time would break that unload (the server then gives up on the model and crashes on exit),
    so the stub leaves SIGINT to the server. (The engine core process ignores it too.)"""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing raises KeyboardInterrupt here then either
        logger.info("initialize() does not run on the stub's main thread; SIGINT left as it is")


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        if not any(isinstance(h, _TritonLogHandler) for h in logger.handlers):
            logger.addHandler(_TritonLogHandler())
            logger.setLevel(logging.INFO)
        _ignore_ctrl_c()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "the llm model must set model_transaction_policy { decoupled: true }"
            )
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = EngineConfig.from_parameters(parameters)
        model_dir = resolve_model_dir(config.model.model, Path(args["model_repository"]))
        self.config = replace(config, model=replace(config.model, model=str(model_dir)))
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self.engine = AsyncLLM(
            self.config,
            self._on_outputs,
            core_mode=self.config.serving.engine_mode,
            max_merged_steps=self.config.serving.max_merged_steps,
            watch_pid=os.getppid(),  # tritonserver
        )
        self.metrics = TritonMetrics(pb_utils, self.engine.stats, args["model_name"], args["model_version"])
        self._server_watch = ServerShutdownWatch(endpoint_of_process(os.getppid()))
        exit_when_server_dies(os.getppid())
        self._stopping = threading.Event()
        self._finalized = threading.Event()
        self._housekeeping = threading.Thread(
            target=self._housekeeping_loop, name="paged_llm-housekeeping", daemon=True
        )
        self._housekeeping.start()

    # ------------------------------------------------------------------------------ Triton threads
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._accept(request)
        return None

    def _accept(self, request: Any) -> None:
        self._server_watch.mark_open()
        sender = request.get_response_sender()
        try:
            inputs = read_inputs(request, INPUT_NAMES, pb_utils.get_input_tensor_by_name)
            parsed = parse_request(inputs, request.parameters(), self.config.limits)
            if parsed.prompt_token_ids is not None:
                prompt_ids = parsed.prompt_token_ids
            else:
                prompt_ids = self.engine.tokenize(parsed.prompt_text or "")
            self.engine.validate(prompt_ids, parsed.params)
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
            self.engine.add_request(request_id, prompt_ids, parsed.params, deadline)
        except (InvalidRequestError, EngineDeadError) as error:
            with stream.lock:
                self._close(stream)
                self._send_error(sender, error)

    def _send_error(self, sender: Any, error: BaseException) -> None:
        code, label = _error_code(error)
        self.metrics.count_final(label)
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), code))
        try:
            sender.send(response, flags=_FINAL)
        except Exception as send_error:  # the client may be gone already
            logger.info("could not send an error response: %s", send_error)

    # ------------------------------------------------------------------------------- output thread
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.accumulator.add(output)
            self._send(stream)

    def _send(self, stream: _Stream) -> None:
        with stream.lock:
            if not stream.closed:
                self._send_locked(stream)

    def _send_locked(self, stream: _Stream) -> None:
        accumulator = stream.accumulator
        if accumulator.finished and accumulator.error is not None:
            self._close(stream)
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
            self._close(stream)
            if stream.cancelled:
                # Finished on its own before the abort landed: the client still asked to cancel.
                self._send_error(stream.sender, RequestAbortedError("cancelled by the client"))
                return
            self.metrics.count_final("success")
        try:
            stream.sender.send(response, flags=_FINAL if accumulator.finished else 0)
            if accumulator.parsed.stream and accumulator.last_response_num_tokens:
                self.engine.stats.on_streamed_response(accumulator.last_response_num_tokens)
        except Exception as error:  # the client went away: stop generating for it
            logger.info("request %s: send failed (%s); aborting", stream.request_id, error)
            if not accumulator.finished:
                stream.cancelled = True
                reason = RequestAbortedError(f"response could not be sent ({error})")
                self.engine.abort(stream.request_id, reason)

    def _close(self, stream: _Stream) -> None:
        """The FINAL response is about to go out: the sender must not be touched after it."""
        stream.closed = True
        with self._streams_lock:
            self._streams.pop(stream.request_id, None)

    # --------------------------------------------------------------------------- housekeeping thread
    def _housekeeping_loop(self) -> None:
        next_cancel_poll = next_metrics = time.monotonic()
        while not self._stopping.wait(_HOUSEKEEPING_INTERVAL_S):
            now = time.monotonic()
            if now >= next_cancel_poll:
                poll_s = self._poll_cancellations()
                # Each is_cancelled() is a round trip to the server process: at hundreds of streams,
                # back off so that polling stays under _CANCEL_POLL_DUTY of this thread's time.
                next_cancel_poll = time.monotonic() + max(
                    _MIN_CANCEL_POLL_INTERVAL_S, poll_s / _CANCEL_POLL_DUTY
                )
            if now >= next_metrics:
                self.metrics.update()
                next_metrics = now + _METRICS_INTERVAL_S
                self._check_server_shutdown()
        self.metrics.update()

    def _check_server_shutdown(self) -> None:
        """The server closed its endpoints (SIGINT/SIGTERM): its clients are gone, and it cannot
        unload us while requests are open, so end them all now, stop the engine core, and leave if
        Triton never finalizes us (see serving/server_watch.py)."""
        if not self.engine.is_accepting or not self._server_watch.shutting_down():
            return
        count = self.engine.abort_all(RequestAbortedError("the server is shutting down"))
        logger.info("tritonserver is shutting down (its port closed): ended %d requests", count)
        threading.Thread(target=self._leave_with_the_server, name="paged_llm-leave", daemon=True).start()

    def _leave_with_the_server(self) -> None:
        endpoint = self._server_watch.endpoint
        self.engine.shutdown(grace_s=self.config.serving.shutdown_grace_s)  # the device memory goes now
        if self._finalized.wait(endpoint.exit_timeout_s + 2.0 if endpoint else 30.0):
            return
        # Triton gave up on unloading us (a client kept its gRPC stream open) and is exiting; no
        # pb_utils call may block us now (they wait on the server), so write to stderr and go.
        print(
            "paged_llm: tritonserver exited without unloading the llm model; the stub exits", file=sys.stderr
        )
        os._exit(0)

    def _poll_cancellations(self) -> float:
        """Asks every in-flight request whether its client cancelled; returns the seconds it took."""
        start = time.monotonic()
        with self._streams_lock:
            streams = [s for s in self._streams.values() if not s.cancelled]
        for stream in streams:
            with stream.lock:
                if stream.closed or stream.cancelled:
                    continue
                try:
                    cancelled = stream.sender.is_cancelled()
                except Exception:  # a sender that cannot answer belongs to a request Triton dropped
                    cancelled = True
                if cancelled:
                    stream.cancelled = True
            if cancelled:
                self.engine.abort(stream.request_id, RequestAbortedError("cancelled by the client"))
        return time.monotonic() - start

    # ---------------------------------------------------------------------------------- shutdown
    def finalize(self) -> None:
        """Stops accepting work, gives in-flight requests a bounded grace period, cancels the rest
        (each gets its CANCELLED final), then stops the engine core and our threads."""
        self._finalized.set()
        self.engine.shutdown(grace_s=self.config.serving.shutdown_grace_s)
        self._stopping.set()
        self._housekeeping.join(timeout=10.0)
        logger.info(
            "paged_llm finalized: output thread alive=%s, housekeeping thread alive=%s",
            self.engine.is_alive,
            self._housekeeping.is_alive(),
        )
