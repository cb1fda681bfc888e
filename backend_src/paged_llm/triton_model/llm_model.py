"""The `llm` model: Triton adapter for the paged_llm engine (decoupled Python backend). The
model repository's `llm/1/model.py` imports this class; everything here runs in Triton's stub.

This stub process holds no model: `execute()` parses, tokenizes and validates each request
(errors answered at once) and hands it to AsyncLLM, whose engine core runs in its own process
(`engine_mode: process`, the default) and owns the device. AsyncLLM's output thread detokenizes and
hands RequestOutputs to ResponseStreams (one response per engine step while it keeps up, merged
steps when it falls behind, and exactly one FINAL; response_streams.py says which threads send).
Threads of this class: two tokenize large prompts, one polls cancellation, one (housekeeping)
refreshes metrics and watches for the server shutting down, one watches for our model's unload,
and one leaves with a server that shuts down without unloading us. What concerns the stub process
itself (its log, SIGINT, stack dumps, the exit the launcher watches) is in stub_process.py.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

import paged_llm
from paged_llm.config import EngineConfig
from paged_llm.engine.async_llm import AsyncLLM
from paged_llm.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.triton_model.auth import ApiKeyCheck
from paged_llm.triton_model.health_probe import HEALTH_PROBE_PARAMETER, answer_health_probe
from paged_llm.triton_model.instance_device import instance_device
from paged_llm.triton_model.lora_admin import LORA_ADMIN_PARAMETER, answer_lora_admin
from paged_llm.triton_model.metrics import TritonMetrics
from paged_llm.triton_model.response_accumulator import ResponseAccumulator
from paged_llm.triton_model.response_streams import ResponseStreams
from paged_llm.triton_model.server_watch import (
    ModelUnloadWatch,
    ServerDeathWatch,
    ServerShutdownWatch,
    endpoint_of_process,
)
from paged_llm.triton_model.stub_process import (
    cancel_stack_dump,
    dump_stacks_if_stuck,
    exit_for_the_launcher,
    ignore_ctrl_c,
    log_to_triton,
)
from paged_llm.triton_model.triton_codec import (
    FORWARDED_ABORT_PARAMETER,
    authorization_of,
    has_request_parameter,
    is_forwarded,
    read_request,
    request_parameter_mapping_raw,
    wants_error_output,
)

_METRICS_INTERVAL_S = 0.5  # gauges and engine state (request figures go with each FINAL)
_UNLOAD_POLL_INTERVAL_S = 0.5
_INLINE_TOKENIZE_CHARS = 16384  # longer text prompts are tokenized on a worker thread
_TOKENIZE_THREADS = 2
logger = logging.getLogger("paged_llm")


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        log_to_triton(pb_utils.Logger)
        ignore_ctrl_c()
        # First of all: every pb_utils call below (metrics, logging) blocks for ever once the server
        # is gone, so a server killed while this model loads must not leave the stub waiting.
        self._server_death_watch = ServerDeathWatch(os.getppid())
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "the llm model must set model_transaction_policy { decoupled: true }"
            )
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = instance_device(
            EngineConfig.from_parameters(parameters),
            args.get("model_instance_kind", ""),
            args.get("model_instance_device_id", "0"),
        )
        model_dir = resolve_model_dir(config.model.model, Path(args["model_repository"]))
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.config = replace(
            config,
            model=replace(config.model, model=str(model_dir)),
            lora=config.lora.with_multi_lora_json(version_dir),  # vllm_backend's adapter list
        )
        gpus = {int(g) for group in model_config.get("instance_group", []) for g in group.get("gpus", [])}
        if self.config.lora.allow_runtime_lora_updates and len(gpus) > 1:
            # one engine core per GPU: an adapter loaded through one instance would be missing in the rest
            raise pb_utils.TritonModelException(
                "allow_runtime_lora_updates needs one engine core: the instance_group puts this model on "
                f"GPUs {sorted(gpus)} (an engine each); give it one GPU, or load adapters at start-up"
            )
        self._api_keys = ApiKeyCheck.from_environment()  # set by `paged-llm serve --api-key`
        if self.config.serving.gil_switch_interval_s:
            sys.setswitchinterval(self.config.serving.gil_switch_interval_s)
        self._ids = itertools.count()
        self._streams: ResponseStreams | None = None
        # Several instances of this model (instance_group count) on one device share one engine
        # core: the first to get here starts it, the others attach (engine/engine_core/stub_links.py). One
        # instance keeps a core of its own, so an in-place reload (the new model loads while the
        # old one still serves) never finds the old core under the shared name.
        num_instances = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
        share_name = None
        if num_instances > 1:
            share_name = "/".join(
                (
                    str(os.getppid()),
                    args["model_name"],
                    args["model_version"],
                    args.get("model_instance_device_id", "0"),
                )
            )
        self.engine = AsyncLLM(
            self.config,
            self._on_outputs,
            core_mode=self.config.serving.engine_mode,
            max_merged_steps=self.config.serving.max_merged_steps,
            watch_pid=os.getppid(),  # tritonserver
            share_name=share_name,
            on_give_up=exit_for_the_launcher,
        )
        self.metrics = TritonMetrics(
            pb_utils,
            self.engine.stats,
            args["model_name"],
            args["model_version"],
            max_model_len=self.engine.info.max_model_len,
            lora_names=self.engine.info.lora_names,
            final_histogram_wait_s=self.config.serving.final_histogram_wait_s,
        )
        self._streams = ResponseStreams(
            pb_utils,
            self.metrics,
            self.engine.stats,
            self.engine.abort,
            self.config.serving.response_send_threads,
        )
        server_endpoint = endpoint_of_process(os.getppid())
        self._server_watch = ServerShutdownWatch(server_endpoint)
        self._unload_watch = ModelUnloadWatch(server_endpoint, args["model_name"], args["model_version"])
        # Daemon threads (not a ThreadPoolExecutor, whose workers the interpreter joins at exit: a
        # pb_utils call blocked on a dead server must never keep the stub from exiting).
        self._admissions: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._tokenize_threads = [
            threading.Thread(target=self._admission_loop, name=f"paged_llm-tokenize-{i}", daemon=True)
            for i in range(_TOKENIZE_THREADS)
        ]
        for thread in self._tokenize_threads:
            thread.start()
        self._stopping = threading.Event()
        self._finalized = threading.Event()
        self._leave_thread: threading.Thread | None = None  # started once the server shuts down
        self._housekeeping = threading.Thread(
            target=self._housekeeping_loop, name="paged_llm-housekeeping", daemon=True
        )
        self._housekeeping.start()
        self._cancel_poller = threading.Thread(
            target=self._cancel_poll_loop, name="paged_llm-cancel-poll", daemon=True
        )
        self._cancel_poller.start()
        self._unload_watch_thread = threading.Thread(
            target=self._watch_for_unload, name="paged_llm-unload-watch", daemon=True
        )
        self._unload_watch_thread.start()
        # Which installation serves (a wheel, an editable checkout) is the first question of a log.
        logger.info("model %s ready; paged_llm from %s", args["model_name"], Path(paged_llm.__file__).parent)
        # What initialize() built lives as long as the model: keep it out of every later garbage
        # collection, which then scans only what the requests create (shorter pauses of the stub).
        gc.freeze()

    # ------------------------------------------------------------------------------ Triton threads
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._accept(request)
        return None

    def _accept(self, request: Any) -> None:
        """On Triton's execute thread: read the request; tokenize a large prompt elsewhere."""
        self._server_watch.mark_open()
        self._unload_watch.mark_ready()
        sender = request.get_response_sender()
        errors_as_output = False
        try:
            triton_request_id = request.request_id()
            errors_as_output = is_forwarded(triton_request_id)
            # Parsed once here (Triton hands them over as JSON text): every helper takes the dict.
            parameters = request_parameter_mapping_raw(request.parameters())
            errors_as_output = wants_error_output(triton_request_id, parameters)
            if HEALTH_PROBE_PARAMETER in parameters:  # answered from our state: no engine, no metrics
                answer_health_probe(pb_utils, sender, self.engine.check_accepting, errors_as_output)
                return
            if self._api_keys.enabled:
                self._api_keys.check(authorization_of(parameters))
            if has_request_parameter(parameters, FORWARDED_ABORT_PARAMETER):
                self._abort_forwarded(parameters, sender)
                return
            if LORA_ADMIN_PARAMETER in parameters:
                answer_lora_admin(
                    self._streams,
                    pb_utils,
                    sender,
                    self.engine,
                    parameters[LORA_ADMIN_PARAMETER],
                    errors_as_output,
                )
                return
            parsed = read_request(request, parameters, self.config.limits, pb_utils.get_input_tensor_by_name)
            timeout_us = request.timeout()
        except InvalidRequestError as error:
            self._streams.send_error(sender, error, errors_as_output)
            return
        except Exception as error:  # a bug of ours: INTERNAL, one line to the client, traceback to the log
            self._internal_error(sender, error, errors_as_output)
            return
        deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
        if parsed.prompt_text is not None and len(parsed.prompt_text) > _INLINE_TOKENIZE_CHARS:
            # Tokenizing a large prompt takes up to a second: not on the thread every request
            # comes through (the tokenizer releases the GIL, so the rest of the stub runs on).
            self._admissions.put((sender, parsed, deadline, triton_request_id, errors_as_output))
        else:
            self._admit(sender, parsed, deadline, triton_request_id, errors_as_output)

    def _admission_loop(self) -> None:
        while (item := self._admissions.get()) is not None:
            self._admit(*item)

    def _admit(
        self,
        sender: Any,
        parsed: Any,
        deadline: float | None,
        triton_request_id: str = "",
        errors_as_output: bool = False,
    ) -> None:
        """Tokenize, validate against the model (the one check of this process: before the stream
        opens, so a refusal is answered at once), and hand the request to the engine (or answer it
        with its error).
        No is_cancelled() here: it is a round trip to the server (0.1-0.4 ms on the GPU hosts), which
        256 requests arriving at once would pay one after the other; the cancel-poll thread's
        cancellation polling finds a request its client already gave up on."""
        try:
            self.engine.check_accepting()  # before tokenizing: no work for a request to be refused
            if parsed.closes_session_only:
                prompt_ids = []
            elif parsed.prompt_token_ids is not None:
                prompt_ids = parsed.prompt_token_ids
            else:
                # A session's later turn continues the text of the turns before: no second BOS.
                later_turn = parsed.session is not None and not parsed.session.start
                add_special_tokens = parsed.add_special_tokens and not later_turn
                prompt_ids = self.engine.tokenize(parsed.prompt_text or "", add_special_tokens)
            prompt_field = "input_ids" if parsed.prompt_token_ids is not None else "text_input"
            if not parsed.closes_session_only:
                self.engine.validate(prompt_ids, parsed.params, prompt_field, parsed.context_must_fit)
        except (InvalidRequestError, EngineDeadError) as error:
            self._streams.send_error(sender, error, errors_as_output)
            return
        except Exception as error:
            self._internal_error(sender, error, errors_as_output)
            return
        try:
            prompt_text = parsed.prompt_text
            if prompt_text is None:
                echo = not parsed.stream and not parsed.exclude_input_in_output
                prompt_text = self.engine.tokenizer.decode(prompt_ids) if echo else ""
            accumulator = ResponseAccumulator(
                parsed, prompt_text, len(prompt_ids), self.config.serving.max_merged_steps
            )
        except Exception as error:
            self._internal_error(sender, error, errors_as_output)
            return
        request_id = f"{next(self._ids)}"
        forwarded_id = triton_request_id if is_forwarded(triton_request_id) else ""
        stream = self._streams.open(request_id, sender, accumulator, forwarded_id, errors_as_output)
        # From here the stream is open: every way out must close it (Triton frees the request's
        # response factory once execute() raises, and polling a freed one crashes the server).
        try:
            self.engine.add_request(
                request_id, prompt_ids, parsed.params, deadline, parsed.session, validated=True
            )
        except (InvalidRequestError, EngineDeadError) as error:
            self._streams.fail(stream, error)
            return
        except Exception:  # a bug of ours (e.g. the tokenizer refusing a bad word)
            logger.exception("request %s: handing it to the engine failed", request_id)
            message = "internal error admitting the request (the server log says why)"
            self._streams.fail(stream, RuntimeError(message))
            return
        if stream.cancelled:  # the poller saw the cancel before the engine knew the request
            self.engine.abort(request_id, RequestAbortedError("cancelled by the client"))

    def _abort_forwarded(self, parameters: dict[str, Any], sender: Any) -> None:
        """llm_trtllm's client cancelled: end the request it forwarded to us (Triton 2.51's BLS
        cannot cancel a request it sent). Answered with an empty FINAL, found or not."""
        target = str(parameters.get(FORWARDED_ABORT_PARAMETER, ""))
        stream = self._streams.find_by_triton_request_id(target) if target else None
        if stream is not None:
            self.engine.abort(stream.request_id, RequestAbortedError("cancelled by the client (llm_trtllm)"))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _internal_error(self, sender: Any, error: Exception, as_output: bool = False) -> None:
        logger.exception("reading a request failed")
        self._streams.send_error(
            sender, RuntimeError("internal error reading the request (the server log says why)"), as_output
        )

    def _on_outputs(self, outputs: list[Any]) -> None:
        """AsyncLLM's output thread (it may deliver a dead core's news before initialize() ends)."""
        if self._streams is not None:
            self._streams.on_outputs(outputs)

    # --------------------------------------------------------------------------- housekeeping thread
    def _housekeeping_loop(self) -> None:
        self.metrics.update()
        while not self._stopping.wait(_METRICS_INTERVAL_S):
            self.metrics.update()
            self._check_server_shutdown()
        self.metrics.update()

    def _cancel_poll_loop(self) -> None:
        """A thread of its own: neither a metrics refresh nor a server probe (up to 0.4 s on a
        busy server) delays noticing a cancelled request."""
        interval_s = 0.0
        while not self._stopping.wait(interval_s):
            interval_s = self._streams.poll_cancellations()

    def _check_server_shutdown(self) -> None:
        """The server closed its endpoints (SIGINT/SIGTERM): its clients are gone, and it cannot
        unload us while requests are open, so end them all now, stop the engine core, and leave if
        Triton never finalizes us (see triton_model/server_watch.py)."""
        if not self.engine.is_accepting or not self._server_watch.shutting_down():
            return
        count = self.engine.abort_all(RequestAbortedError("the server is shutting down"))
        logger.info("tritonserver is shutting down (its port closed): ended %d requests", count)
        leave = threading.Thread(target=self._leave_with_the_server, name="paged_llm-leave", daemon=True)
        leave.start()
        self._leave_thread = leave  # (published once started: finalize() joins it)

    def _watch_for_unload(self) -> None:
        """Its own thread (the server may take seconds to answer under load). Once our model is
        being unloaded (see ModelUnloadWatch): Triton finalizes us only after every request in
        flight has ended, so give them shutdown_grace_s and cancel the rest now."""
        while not self._stopping.wait(_UNLOAD_POLL_INTERVAL_S):
            if self.engine.is_accepting and self._unload_watch.unloading():
                break
        else:
            return
        logger.info(
            "the model is being unloaded: %d requests in flight get %.1f s to finish, then CANCELLED",
            self.engine.num_unfinished_requests,
            self.config.serving.shutdown_grace_s,
        )
        if not self._finalized.is_set():  # (finalize() cancels the dump as it returns)
            dump_stacks_if_stuck(self.config.serving.shutdown_grace_s)
        self.engine.shutdown(grace_s=self.config.serving.shutdown_grace_s)

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

    # ---------------------------------------------------------------------------------- shutdown
    def finalize(self) -> None:
        """Stops accepting work, gives in-flight requests a bounded grace period, cancels the rest
        (each gets its CANCELLED final), then stops the engine core and our threads."""
        dump_stacks_if_stuck(self.config.serving.shutdown_grace_s)
        self._finalized.set()
        self.engine.shutdown(grace_s=self.config.serving.shutdown_grace_s)
        for _ in self._tokenize_threads:  # what waits there is answered UNAVAILABLE now
            self._admissions.put(None)
        for thread in self._tokenize_threads:
            thread.join(timeout=5.0)
        self._streams.stop()
        self._stopping.set()
        self._housekeeping.join(timeout=10.0)
        self.metrics.stop()
        self._cancel_poller.join(timeout=10.0)
        # No thread of ours may run on while the stub tears its interpreter down (ServerDeathWatch).
        # The unload watch may be inside a readiness request (5 s to connect, 5 s to read).
        self._unload_watch_thread.join(timeout=12.0)
        if self._leave_thread is not None:
            self._leave_thread.join(timeout=5.0)
        self._server_death_watch.stop()
        left = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith("paged_llm-") and t is not threading.current_thread() and t.is_alive()
        ]
        logger.info(
            "paged_llm finalized: output thread alive=%s, housekeeping thread alive=%s, threads left: %s",
            self.engine.is_alive,
            self._housekeeping.is_alive(),
            ", ".join(left) or "none",
        )
        cancel_stack_dump()
