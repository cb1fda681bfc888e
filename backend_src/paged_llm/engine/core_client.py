"""How the stub talks to the engine core: one interface, three places for the core to run.

| mode        | where the core runs                | used by                                             |
|-------------|------------------------------------|-----------------------------------------------------|
| `inprocess` | stepped by the caller (no thread)  | the offline LLMEngine: tests, benchmarks, debugging |
| `thread`    | a busy-loop thread of this process | `engine_mode: thread` in config.pbtxt (debugging)   |
| `process`   | its own process (the default)      | serving: the core never shares a GIL with Triton    |

`auto` (offline LLMEngine, benchmarks): `process` on an accelerator, `inprocess` on a CPU. On an
accelerator the core's loop and the output processing each take about as long as a large decode step
(docs/benchmarks/step-breakdown.md), and in one process they add up; on a CPU a second process only
takes cores from the forward.

The process mode's clients (start a core, or join the one another instance started) live in
engine/core_process_client.py.

Every client: `add_request`, `abort_requests`, `send_utility`, `get_outputs(timeout_s)` (the next
EngineCoreOutputs, or None), `poll_outputs()` (without waiting), `shutdown()`. Only one thread
reads outputs. A dead core makes every call raise EngineDeadError, with the reason.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import Any, Protocol

from paged_llm.config import ConfigError, EngineConfig
from paged_llm.engine.core_types import (
    AbortRequest,
    CoreInput,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
)
from paged_llm.errors import EngineDeadError

logger = logging.getLogger(__name__)
CORE_MODES = ("process", "thread", "inprocess")
PARKED_WAIT_S = 0.05  # an in-process core with only requests waiting for a grammar waits this long per call


class EngineCoreClient(Protocol):
    info: EngineCoreInfo
    request_id_prefix: str  # every request id sent to the core starts with it
    owns_core: bool  # False: a core shared with other stubs, which shutdown() only leaves

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, aborts: list[AbortRequest]) -> None: ...

    def send_utility(self, name: str, *args: Any) -> int: ...

    def get_outputs(self, timeout_s: float | None = None) -> EngineCoreOutputs | None: ...

    def poll_outputs(self) -> EngineCoreOutputs | None: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...


def resolve_core_mode(config: EngineConfig, mode: str) -> str:
    """`auto` made concrete for this config's device; every other mode as given."""
    if mode != "auto":
        return mode
    from paged_llm.runner.device import Device

    return "inprocess" if Device.resolve(config.device.device).is_cpu else "process"


def start_core_and_tokenizer(
    config: EngineConfig,
    mode: str,
    show_progress: bool = False,
    watch_pid: int | None = None,
    share_name: str | None = None,
) -> tuple[EngineCoreClient, Any]:
    """Starts the engine core (or joins a shared one) and loads the tokenizer at the same time
    (each takes seconds)."""
    from paged_llm.models.builtin import resolve_model_dir
    from paged_llm.tokenizer.fast_tokenizer import load_stub_tokenizer

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paged_llm-tokenizer") as pool:
        tokenizer = pool.submit(load_stub_tokenizer, resolve_model_dir(config.model.model))
        client = make_core_client(config, mode, show_progress, watch_pid, share_name)
        return client, tokenizer.result()


def make_core_client(
    config: EngineConfig,
    mode: str,
    show_progress: bool = False,
    watch_pid: int | None = None,
    share_name: str | None = None,
) -> EngineCoreClient:
    """`watch_pid` (process mode): the core also exits when that process is gone. `share_name`
    (process mode): callers passing the same name share one core (connect_engine_core)."""
    if mode == "inprocess":
        return InProcessCoreClient(config, show_progress)
    if mode == "thread":
        return ThreadedCoreClient(config, show_progress)
    if mode == "process":
        from paged_llm.engine.core_process_client import connect_engine_core

        return connect_engine_core(config, watch_pid, share_name)
    raise ConfigError(f"engine_mode must be one of {', '.join(CORE_MODES)}, got {mode!r}")


class InProcessCoreClient:
    """The core stepped by the caller: `get_outputs()` runs one step (or returns what aborts and
    refusals produced). add_request raises its errors directly."""

    request_id_prefix = ""
    owns_core = True

    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        from paged_llm.engine.engine_core.core import EngineCore

        self.core = EngineCore(config, show_progress=show_progress)
        self.info = self.core.info
        self._call_ids = itertools.count()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, aborts: list[AbortRequest]) -> None:
        for abort in aborts:
            self.core.apply_abort(abort)

    def send_utility(self, name: str, *args: Any) -> int:
        from paged_llm.engine.engine_core.step_loop import call_utility

        call_id = next(self._call_ids)
        self.core.record_utility_result(call_id, call_utility(self.core, name, args))
        return call_id

    def get_outputs(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        if not self.core.has_unfinished_requests():
            return self.core.take_outputs()
        self.core.wait_for_work(PARKED_WAIT_S)
        return self.core.step()

    def poll_outputs(self) -> EngineCoreOutputs | None:
        return None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.core.abort_all("the engine is shutting down")
        self.core.close()


class _QueueLink:
    """Shared by the thread client: the inbox side raises once the core is dead."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[EngineCoreOutputs | BaseException] = queue.SimpleQueue()


class ThreadedCoreClient:
    """The core's busy loop on a thread of this process."""

    request_id_prefix = ""
    owns_core = True

    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        from paged_llm.engine.engine_core.core import EngineCore

        core = EngineCore(config, show_progress=show_progress)
        self.info = core.info
        self._link = _QueueLink()
        self._call_ids = itertools.count()
        self.death_reason: str | None = None
        self._thread = threading.Thread(target=self._run, args=(core,), name="paged_llm-core", daemon=True)
        self._thread.start()

    def _run(self, core) -> None:
        from paged_llm.engine.engine_core.step_loop import run_busy_loop

        try:
            run_busy_loop(core, self._link.inbox, self._link.outbox.put)
        except BaseException as error:
            logger.exception("engine core thread crashed")
            self.death_reason = f"the engine core thread crashed: {type(error).__name__}: {error}"
        else:
            self.death_reason = "the engine core was shut down"
        finally:
            core.close()
        self._link.outbox.put(EngineDeadError(self.death_reason))

    def _put(self, item: CoreInput) -> None:
        if self.death_reason is not None:
            raise EngineDeadError(self.death_reason)
        self._link.inbox.put(item)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._put(request)

    def abort_requests(self, aborts: list[AbortRequest]) -> None:
        for abort in aborts:
            self._put(abort)

    def send_utility(self, name: str, *args: Any) -> int:
        call_id = next(self._call_ids)
        self._put(UtilityCall(call_id, name, args))
        return call_id

    def get_outputs(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self._link.outbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return self._check(item)

    def poll_outputs(self) -> EngineCoreOutputs | None:
        try:
            return self._check(self._link.outbox.get_nowait())
        except queue.Empty:
            return None

    def _check(self, item: EngineCoreOutputs | BaseException) -> EngineCoreOutputs:
        if isinstance(item, BaseException):
            self._link.outbox.put(item)  # every later read fails the same way
            raise item
        return item

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._link.inbox.put(Shutdown("the engine is shutting down"))
            self._thread.join(timeout=timeout_s)
