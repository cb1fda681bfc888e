"""AsyncLLM: the engine as a Triton stub runs it. Requests come from any thread; outputs leave on one thread.

    requests ──add_request / abort──> engine core (own process by default)
                                             │ one EngineCoreOutputs per step
    on_outputs(list[RequestOutput]) <── output thread: read what arrived (up to max_merged_steps
                                        steps), detokenize, stop strings, one RequestOutput per
                                        request with news

While the consumer keeps up, each pass holds one engine step, so a stream gets one response per
step. When it falls behind, the steps that piled up are merged into one pass (at most
`max_merged_steps`), so a slow sender sends fewer, larger responses instead of falling further back.

Every request ends with exactly one final RequestOutput (`finished`), with `error` set when it failed
or was aborted. If the core dies, every request in flight gets EngineCoreDiedError at once and new
ones are refused with EngineDeadError (saying when to retry) while the output thread starts a fresh
core (process mode: the same configuration and entry, make_core_client; a shared core is started
by the first stub to get there, the others attach) after a backoff (engine/restart_policy.py).
Past `engine_max_restarts` failures within `engine_restart_window_s` (and at once in thread mode)
it gives up: `on_give_up` is called (the Triton stub exits) and requests stay refused.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from paged_llm.config import EngineConfig
from paged_llm.core.sessions import SessionTurn
from paged_llm.engine.core_client import EngineCoreClient, make_core_client, start_core_and_tokenizer
from paged_llm.engine.core_types import AbortRequest, EngineCoreOutputs, EngineCoreRequest, utility_error
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.outputs import RequestOutput
from paged_llm.engine.restart_policy import RestartPolicy
from paged_llm.engine.stats import EngineStats
from paged_llm.engine.validation import validate_context_fit, validate_params, validate_prompt
from paged_llm.errors import EngineCoreDiedError, EngineDeadError, RequestAbortedError
from paged_llm.processes import process_is_alive
from paged_llm.sampling.bad_words import with_bad_words_tokenized
from paged_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
OutputHandler = Callable[[list[RequestOutput]], None]
GiveUpHandler = Callable[[str], None]
_WAKE_INTERVAL_S = 0.02  # the output thread looks at local aborts at least this often
_CORE_SETTLE_S = 5.0  # shutdown: how long to wait for the core to confirm the last aborts


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        on_outputs: OutputHandler,
        core_mode: str = "process",
        max_merged_steps: int = 16,
        watch_pid: int | None = None,
        share_name: str | None = None,
        on_give_up: GiveUpHandler | None = None,
    ) -> None:
        """`watch_pid`: the core process also exits when that process is gone (under Triton: the
        server, in case this stub hangs after it died). `share_name` (process mode): AsyncLLMs
        passing the same name share one engine core (several Triton instances of one model).
        `on_give_up(reason)`: called on the output thread once a dead core is not restarted."""
        if core_mode == "inprocess":
            core_mode = "thread"  # serving needs the core to step on its own
        self._config, self._core_mode = config, core_mode
        self._watch_pid, self._share_name = watch_pid, share_name
        self._on_give_up = on_give_up
        serving = config.serving
        self._restart_policy = RestartPolicy(serving.engine_max_restarts, serving.engine_restart_window_s)
        self._restarting = False  # dead_reason is set and a new core is on its way
        self._client_lock = threading.Lock()  # a restarted core is adopted, or shutdown() takes it
        self.client: EngineCoreClient
        self.client, self.tokenizer = start_core_and_tokenizer(
            config, core_mode, watch_pid=watch_pid, share_name=share_name
        )
        self.info = self.client.info
        self._fault_bad_word = config.fault_injection_bad_word
        self.owns_core = self.client.owns_core
        self.stats = EngineStats()
        self.stats.on_core_up(self.owns_core)
        self.processor = OutputProcessor(self.tokenizer, self.stats)
        self.processor.core_id_prefix = self.client.request_id_prefix
        self.max_merged_steps = max(1, max_merged_steps)
        self.num_merged_passes = 0  # output passes that held more than one engine step
        self._on_outputs = on_outputs
        self._lock = threading.Lock()  # guards the processor
        self._local_aborts: queue.SimpleQueue[tuple[str, BaseException]] = queue.SimpleQueue()
        # utility call id -> the caller's future of (ok, value), set by the output thread
        self._utility_waiters: dict[int, concurrent.futures.Future[tuple[bool, object]]] = {}
        # LoRA adapters loaded through this stub while serving (name -> path): a restarted core
        # gets them again before any request
        self._runtime_lora_adapters: dict[str, str] = {}
        self._accepting = True
        self.dead_reason: str | None = None
        self._stop = threading.Event()
        self._shutdown_lock = threading.Lock()
        self._thread = threading.Thread(target=self._output_loop, name="paged_llm-outputs", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- any thread
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        deadline: float | None = None,
        session: SessionTurn | None = None,
        *,
        validated: bool = False,
    ) -> None:
        """Queues a request. Raises InvalidRequestError (bad input) or EngineDeadError (not serving);
        otherwise its outputs, and exactly one final, reach `on_outputs`. `session`: a turn of that
        session (`prompt_token_ids` holds only its new tokens; none, with session.end: a close).
        `validated`: the caller ran `validate` on these already (the Triton stub does, before it
        opens the request's response stream), so this process checks a request once."""
        self.check_accepting()
        if self._fault_bad_word is not None and self._fault_bad_word in params.bad_words:
            raise TypeError("injected admission fault (fault_injection_bad_word)")
        params = with_bad_words_tokenized(params, self.tokenize)
        if not validated and (session is None or not session.closes_only(prompt_token_ids)):
            self.validate(prompt_token_ids, params)
        arrival_time = time.monotonic()
        with self._lock:
            core_id = self.processor.add_request(
                request_id, prompt_token_ids, params, arrival_time, in_session=session is not None
            )
        try:
            self.client.add_request(
                EngineCoreRequest(core_id, prompt_token_ids, params, arrival_time, deadline, session)
            )
        except Exception:  # EngineDeadError, or a bug: the request is not the processor's either
            with self._lock:
                self.processor.remove_request(request_id)
            raise

    def call_utility(self, name: str, *args: object, timeout_s: float = 120.0) -> object:
        """Runs EngineCore.<name>(*args) between two steps and returns its result (any thread but
        the output thread); InvalidRequestError for a refused input, EngineDeadError without a core."""
        self.check_accepting()
        future: concurrent.futures.Future[tuple[bool, object]] = concurrent.futures.Future()
        with self._lock:  # registered before the output thread can see the answer
            call_id = self.client.send_utility(name, *args)
            self._utility_waiters[call_id] = future
        try:
            ok, value = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._utility_waiters.pop(call_id, None)
            raise EngineDeadError(f"the engine core did not answer {name} in {timeout_s:.0f} s") from None
        if not ok:
            raise utility_error(name, value)
        return value

    def load_lora_adapter(self, name: str, path: str) -> tuple[str, ...]:
        """Serves LoRA adapter `name` from `path` from now on (and after a core restart); the
        adapters a request may name."""
        names = self.call_utility("load_lora_adapter", name, path)
        self._runtime_lora_adapters[name] = path
        return names  # type: ignore[return-value]

    def unload_lora_adapter(self, name: str) -> tuple[str, ...]:
        """New requests for `name` are refused from now on; those in flight finish with it."""
        names = self.call_utility("unload_lora_adapter", name)
        self._runtime_lora_adapters.pop(name, None)
        return names  # type: ignore[return-value]

    def lora_adapter_names(self) -> tuple[str, ...]:
        return self.call_utility("lora_adapter_names")  # type: ignore[return-value]

    def check_accepting(self) -> None:
        """EngineDeadError (UNAVAILABLE) if a new request would be refused now."""
        if self.dead_reason is not None:
            if self._restarting:
                raise EngineDeadError(
                    f"the engine is not serving: {self.dead_reason}; it is being restarted, "
                    "retry in a few seconds"
                )
            raise EngineDeadError(f"the engine is not serving: {self.dead_reason}")
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down")

    def abort(self, request_id: str, error: BaseException) -> None:
        """Ends a request; its final output (carrying `error`) follows on the output thread."""
        with self._lock:
            core_id = self.processor.core_request_id(request_id)
        if core_id is None:
            return  # already finished
        # The core first, then the final: a client that sends its next request once it has the
        # final (a session's next turn) must find this one ended in the core, not still running.
        try:
            self.client.abort_requests([AbortRequest(core_id, None, str(error))])
        except EngineDeadError:
            pass  # the output thread fails everything in flight anyway
        self._local_aborts.put((request_id, error))

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_field: str = "text_input",
        context_must_fit: bool = False,
    ) -> None:
        """InvalidRequestError if the request can never be served by this model and pool (or, with
        `context_must_fit`, if prompt + max_tokens is past max_model_len)."""
        validate_prompt(self.info, prompt_token_ids, prompt_field)
        validate_params(self.info, params, in_core=False)
        if context_must_fit:
            validate_context_fit(self.info, len(prompt_token_ids), params)

    @property
    def num_unfinished_requests(self) -> int:
        return self.processor.num_unfinished_requests

    def tokenize(self, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: as the tokenizer adds them to a text (Llama's BOS; Qwen adds none),
        what vLLM does to a text prompt; off for rendered chat templates and for bad words."""
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    # ----------------------------------------------------------------------------- output thread
    def _output_loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self.client.get_outputs(timeout_s=_WAKE_INTERVAL_S)
                batch = [] if first is None else [first]
                while batch and len(batch) < self.max_merged_steps:
                    more = self.client.poll_outputs()
                    if more is None:
                        break
                    batch.append(more)
            except EngineDeadError as error:
                if self._recover(str(error)):
                    continue
                self._idle_dead()
                return
            if len(batch) > 1:
                self.num_merged_passes += 1
            outputs = self._absorb(batch)
            if outputs:
                self._deliver(outputs)

    def _absorb(self, batch: list[EngineCoreOutputs]) -> list[RequestOutput]:
        aborts: list[AbortRequest] = []
        outputs: list[RequestOutput] = []
        with self._lock:
            touched: set[str] = set()
            for core_outputs in batch:
                for call_id, result in core_outputs.utility_results.items():
                    waiter = self._utility_waiters.pop(call_id, None)
                    if waiter is not None:
                        waiter.set_result(result)
                step_touched, step_aborts = self.processor.process(core_outputs)
                touched |= step_touched
                aborts += step_aborts
            while True:
                try:
                    request_id, error = self._local_aborts.get_nowait()
                except queue.Empty:
                    break
                final = self.processor.abort_request(request_id, error)
                if final is not None:
                    outputs.append(final)
            merged = self.processor.collect(touched)
            for output in merged:
                output.num_steps = max(1, len(batch))
            outputs += merged
        if aborts:
            try:
                self.client.abort_requests(aborts)
            except EngineDeadError:
                pass
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        try:
            self._on_outputs(outputs)
        except Exception:
            logger.exception("the output handler failed")

    def _fail_in_flight(self, reason: str) -> None:
        with self._lock:
            waiters, self._utility_waiters = self._utility_waiters, {}
            for waiter in waiters.values():
                waiter.set_exception(EngineDeadError(f"{reason}; the call was lost"))
            in_flight = list(self.processor.requests)
            finals = [
                self.processor.abort_request(
                    request_id, EngineCoreDiedError(f"{reason}; the request was lost")
                )
                for request_id in in_flight
            ]
        if in_flight:
            logger.error("%s with %d requests in flight: they fail with INTERNAL", reason, len(in_flight))
        self._deliver([f for f in finals if f is not None])

    def _recover(self, reason: str) -> bool:
        """The core died: fail what was in flight, then start a new core (after a backoff, until
        the restart policy gives up). True once a new core serves; False when this stub stops
        or gives up (dead_reason then says why)."""
        self._restarting = self._core_mode == "process"
        self.dead_reason = reason
        self.stats.on_core_lost(counted_its_totals=self.owns_core)
        self._fail_in_flight(reason)
        self.client.shutdown()  # (what is left of it: the link)
        while True:
            delay_s = self._restart_policy.on_failure(time.monotonic()) if self._restarting else None
            if delay_s is None:
                self._give_up(reason)
                return False
            logger.warning(
                "%s: restarting the engine core in %.1f s (failure %d of at most %d within %.0f s)",
                reason,
                delay_s,
                self._restart_policy.failures_in_window,
                self._restart_policy.max_restarts,
                self._restart_policy.window_s,
            )
            if not self._idle_until(time.monotonic() + delay_s) or not self._may_restart():
                self._restarting = False
                return False
            try:
                client = make_core_client(
                    self._config, self._core_mode, watch_pid=self._watch_pid, share_name=self._share_name
                )
            except Exception as error:  # (a ConfigError cannot be: the same config started before)
                # The details (a pid, the shared core's name) are for the log, not for clients.
                logger.error("restarting the engine core failed: %s", error)
                reason = "the engine core could not be restarted (the server log says why)"
                self.dead_reason = reason
                continue
            with self._client_lock:
                if not self._may_restart():
                    client.shutdown()
                    self._restarting = False
                    return False
                self._adopt(client)
            logger.warning("the engine core was restarted and serves again")
            return True

    def _may_restart(self) -> bool:
        """Not while stopping, nor once the server the core watches is gone (it would exit too)."""
        if self._stop.is_set() or not self._accepting:
            return False
        return self._watch_pid is None or process_is_alive(self._watch_pid)

    def _adopt(self, client: EngineCoreClient) -> None:
        for name, path in self._runtime_lora_adapters.items():  # ahead of every new request
            try:
                client.send_utility("load_lora_adapter", name, path)  # (its answer is nobody's)
            except Exception as error:
                logger.error("LoRA adapter %r could not be loaded into the restarted core: %s", name, error)
        self.client = client
        self.info = client.info
        self.owns_core = client.owns_core
        with self._lock:
            self.processor.core_id_prefix = client.request_id_prefix
        self.stats.on_core_up(client.owns_core)
        self._restarting = False
        self.dead_reason = None  # last: requests are accepted from here

    def _give_up(self, reason: str) -> None:
        self._restarting = False
        if self._core_mode == "process":
            policy = self._restart_policy
            reason = (
                f"{reason}; it failed {policy.failures_in_window} times within "
                f"{policy.window_s:.0f} s (engine_max_restarts {policy.max_restarts}): not restarted"
            )
        self.dead_reason = reason
        logger.error("the engine gives up: %s", reason)
        if self._on_give_up is not None and self._accepting:
            try:
                self._on_give_up(reason)
            except Exception:
                logger.exception("the give-up handler failed")

    def _idle_until(self, deadline: float) -> bool:
        """Keeps answering aborts (of nothing: no request is in flight) until `deadline`; False if
        the engine is stopped meanwhile."""
        while time.monotonic() < deadline:
            if self._stop.wait(min(_WAKE_INTERVAL_S, max(0.0, deadline - time.monotonic()))):
                return False
            self._absorb([])
        return not self._stop.is_set()

    def _idle_dead(self) -> None:
        while not self._stop.wait(_WAKE_INTERVAL_S):  # keep answering aborts of nothing, cheaply
            self._absorb([])

    # ---------------------------------------------------------------------------------- shutdown
    def abort_all(self, error: BaseException, stop_accepting: bool = True) -> int:
        """Ends every request in flight with `error` (and, by default, refuses new ones); returns
        how many there were."""
        if stop_accepting:
            self._accepting = False
        request_ids = list(self.processor.requests)
        for request_id in request_ids:
            self.abort(request_id, error)
        return len(request_ids)

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops accepting, lets in-flight requests run up to `grace_s`, aborts the rest (each gets
        its final), stops the output thread and the core."""
        with self._shutdown_lock:  # finalize() and an unload or server-shutdown thread may race
            self._accepting = False
            deadline = time.monotonic() + grace_s
            while self.processor.has_unfinished_requests() and time.monotonic() < deadline:
                if not self._thread.is_alive():
                    break
                time.sleep(0.01)
            self.abort_all(RequestAbortedError("the server is shutting down"))
            while self.processor.has_unfinished_requests() and self._thread.is_alive():
                time.sleep(0.01)
            # The core ends the aborted sequences at its next loop and says so in its stats: wait for
            # that (briefly), so that the last stats and metrics do not count requests that are gone.
            # (A stub sharing the core does not report its stats: other stubs' requests.)
            settle_deadline = time.monotonic() + (_CORE_SETTLE_S if self.owns_core else 0.0)
            while self._thread.is_alive() and time.monotonic() < settle_deadline:
                snapshot = self.stats.snapshot()
                if snapshot.num_running == 0 and snapshot.num_waiting == 0:
                    break
                time.sleep(0.01)
            with self._client_lock:  # a core restarting meanwhile is shut down by _recover
                self._stop.set()
            self._thread.join(timeout=10.0)
            with self._lock:
                waiters, self._utility_waiters = self._utility_waiters, {}
            for waiter in waiters.values():
                waiter.set_exception(EngineDeadError("the engine is shutting down"))
            self.client.shutdown()

    @property
    def is_accepting(self) -> bool:
        """Not shutting down and not given up (a core being restarted will accept again)."""
        return self._accepting and (self.dead_reason is None or self._restarting)

    @property
    def is_serving(self) -> bool:
        """A request admitted now would run: accepting, and the engine core is up."""
        return self._accepting and self.dead_reason is None

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()
