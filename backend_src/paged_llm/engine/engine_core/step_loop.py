"""The engine core's busy loop: take new requests and aborts, step, publish, again.

Shared by the core process (engine/engine_core/process.py) and the in-thread client (engine/core_client.py):

    while running:
        drain the inbox (block only when the core has nothing to do)
        step() if there is work, else collect what the inbox caused (refusals, aborts)
        publish the step's EngineCoreOutputs, if it holds anything

On an accelerator (`pipelined`) the core keeps one step running while the loop publishes the one
before (EngineCore.step_pipelined), so that serializing and sending outputs overlaps the device work;
with asynchronous scheduling the next step is even launched before the previous one's tokens are
read back:

    launch(N+1) -> finish(N) -> publish(N) -> drain -> launch(N+2) -> finish(N+1) -> publish(N+1) ...

(on a CPU launching is the step itself, so outputs go out as soon as they exist).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from paged_llm.engine.core_types import (
    AbortRequest,
    AbortStub,
    CoreError,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
)
from paged_llm.engine.engine_core.core import EngineCore
from paged_llm.errors import InvalidRequestError, QueueFullError, SessionNotFoundError

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the inbox before looking around again


class _WakeUp:
    """Put into the inbox by `EngineCore.wake` (a compiled grammar): the loop looks again."""


_WAKE_UP = _WakeUp()


def run_busy_loop(
    core: EngineCore,
    inbox: queue.SimpleQueue[CoreInput],
    publish: Callable[[EngineCoreOutputs], None],
) -> str:
    """Runs until a Shutdown arrives; aborts what is left, publishes that, returns the reason.
    An exception from the core propagates: the caller reports the core as dead."""
    core.wake = lambda: inbox.put(_WAKE_UP)  # type: ignore[arg-type]
    while True:
        idle = not core.has_work()
        shutdown = _drain_inbox(core, inbox, block=idle)
        if shutdown is not None:
            core.abort_all(shutdown.reason)
            publish(core.finish_in_flight())
            return shutdown.reason
        if core.pipelined:
            outputs = core.step_pipelined()
        else:
            in_flight = core.launch_step() if core.has_unfinished_requests() else None
            outputs = core.finish_step(in_flight)
        if not outputs.is_empty:
            publish(outputs)


def _drain_inbox(core: EngineCore, inbox: queue.SimpleQueue[CoreInput], block: bool) -> Shutdown | None:
    while True:
        try:
            item = inbox.get(timeout=IDLE_WAIT_S) if block else inbox.get_nowait()
        except queue.Empty:
            return None
        block = False
        if isinstance(item, Shutdown):
            return item
        if item is not _WAKE_UP:
            handle_input(core, item)


def handle_input(core: EngineCore, item: CoreInput) -> None:
    if isinstance(item, EngineCoreRequest):
        try:
            core.add_request(item)
        except InvalidRequestError as error:
            core.reject(item.request_id, CoreError("invalid_arg", str(error).split(": ", 1)[-1], error.field))
        except QueueFullError as error:
            core.reject(item.request_id, CoreError("unavailable", str(error)))
        except SessionNotFoundError as error:
            core.reject(item.request_id, CoreError("not_found", str(error).split(": ", 1)[-1], error.field))
    elif isinstance(item, AbortRequest):
        core.apply_abort(item)
    elif isinstance(item, UtilityCall):
        core.record_utility_result(item.call_id, call_utility(core, item.name, item.args))
    elif isinstance(item, AbortStub):
        core.abort_all(item.reason, item.request_id_prefix)
    else:
        raise TypeError(f"unexpected engine core input {item!r}")


def call_utility(core: EngineCore, name: str, args: tuple = ()) -> tuple[bool, object]:
    """(True, result) or (False, "ExceptionType: message"), a refused input as (False,
    InvalidRequestError's (field, message)) (utility_error() raises either); never raises."""
    if name not in EngineCore.UTILITY_CALLS:
        return False, f"unknown utility call {name!r}"
    try:
        return True, getattr(core, name)(*args)
    except InvalidRequestError as error:
        return False, (error.field, str(error).removeprefix(f"{error.field}: "))
    except Exception as error:  # reported to the caller; the core keeps running
        return False, f"{type(error).__name__}: {error}"
