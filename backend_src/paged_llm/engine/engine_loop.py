"""Runs the engine on its own thread: a thread-safe inbox of submits and aborts, `step()` in a loop,
and every RequestOutput handed to its request's callback (on the engine thread; keep callbacks short)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.engine.outputs import RequestOutput
from paged_llm.errors import EngineDeadError, QueueFullError
from paged_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    callback: OutputCallback
    deadline: float | None


@dataclass
class _Abort:
    request_id: str
    reason: str


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "paged_llm-engine") -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._accepting = True
        self._stop = threading.Event()
        self._dead_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead_error is None

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        callback: OutputCallback,
        deadline: float | None = None,
    ) -> None:
        """Queues a request; its outputs (or its error) reach `callback` on the engine thread."""
        if not self._accepting or self._dead_error is not None:
            reason = self._dead_error or "the engine is shutting down"
            raise EngineDeadError(f"not accepting requests: {reason}")
        self._inbox.put(_Submit(request_id, prompt_token_ids, params, callback, deadline))

    def abort(self, request_id: str, reason: str = "cancelled by the client") -> None:
        """Ends a request within one step; its final output carries a RequestAbortedError(reason)."""
        self._inbox.put(_Abort(request_id, reason))

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops accepting work, lets in-flight requests run up to `grace_s`, aborts the rest, joins."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._callbacks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=max(grace_s, 1.0) + 10.0)

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output)
        except BaseException as error:  # a bug in the engine itself: fail everything, refuse new work
            logger.error("engine loop crashed:\n%s", "".join(traceback.format_exception(error)))
            self._dead_error = error
            self._fail_all(error)
            self._drain_inbox(block=False)
            return
        self._abort_all()

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if isinstance(item, _Abort):
                output = self.engine.abort_request(item.request_id, item.reason)
                if output is not None:
                    self._deliver(output)
                continue
            self._add(item)

    def _add(self, item: _Submit) -> None:
        try:
            if self._dead_error is not None:
                raise EngineDeadError(f"the engine stopped after an internal error: {self._dead_error}")
            max_queued = self.engine.config.scheduler.max_queued_requests
            if self.engine.num_waiting_requests >= max_queued:
                raise QueueFullError(f"the waiting queue is full ({max_queued} requests); retry later")
            self._callbacks[item.request_id] = item.callback
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, item.deadline)
        except Exception as error:
            self._callbacks.pop(item.request_id, None)
            _safe_call(
                item.callback, RequestOutput(item.request_id, len(item.prompt_token_ids), [], True, error)
            )

    def _deliver(self, output: RequestOutput) -> None:
        callback = (
            self._callbacks.pop(output.request_id)
            if output.finished
            else self._callbacks.get(output.request_id)
        )
        if callback is not None:
            _safe_call(callback, output)

    def _abort_all(self) -> None:
        for request_id in list(self.engine.groups):
            output = self.engine.abort_request(request_id, "the server is shutting down")
            if output is not None:
                self._deliver(output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, callback in list(self._callbacks.items()):
            _safe_call(callback, RequestOutput(request_id, 0, [], True, error))
        self._callbacks.clear()


def _safe_call(callback: OutputCallback, output: RequestOutput) -> None:
    try:
        callback(output)
    except Exception:
        logger.exception("output callback for request %s failed", output.request_id)
