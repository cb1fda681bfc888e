"""Step-failure handling: a model step that raised fails the requests it carried (INTERNAL), drops
KV that may be garbage and lets the core keep serving; a step launched on a failed step's KV fails
with it."""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING

from paged_llm.engine.core_types import CoreError
from paged_llm.sequence import SequenceStatus

if TYPE_CHECKING:
    from paged_llm.core.scheduler import ScheduledSequence
    from paged_llm.engine.core import EngineCore, InFlightStep, _CoreRequest

logger = logging.getLogger(__name__)


def fail_launched_after_fault(core: EngineCore, in_flight: InFlightStep) -> None:
    """Step N failed with N+1 already launched: N+1 read N's KV and may have read prefix-cache
    blocks that N was writing (they count as computed from launch on), so its requests fail too."""
    try:
        in_flight.launched.result()
    except Exception:  # the device fault shows here as well; the step fails either way
        pass
    fail_step(
        core,
        in_flight.scheduler_output.scheduled,
        RuntimeError(f"launched before step {in_flight.step_number - 1} failed, on its KV"),
        in_flight.step_number,
        is_fault=False,
    )


def fail_step(
    core: EngineCore,
    scheduled: list[ScheduledSequence],
    error: Exception,
    step_number: int,
    is_fault: bool = True,
) -> None:
    """A model fault: fail every request of the step (INTERNAL), drop cached KV, keep serving.
    `is_fault=False`: the step failed because of another step's fault (not counted again).
    A collective that failed because a tensor-parallel worker died raises WorkerDiedError."""
    core.runner.check_workers()
    logger.error(
        "model step %d failed; failing %d sequences:\n%s",
        step_number,
        len(scheduled),
        "".join(traceback.format_exception(error)),
    )
    core.num_step_faults += int(is_fault)
    records: dict[int, _CoreRequest] = {}
    for item in scheduled:
        owner = None if item.seq.is_finished else core._owner.get(item.seq_id)
        # The id may belong to a newer request by now (aborted, then reused): match the object.
        if owner is not None and owner[0].sequences[owner[1]] is item.seq:
            records[id(owner[0])] = owner[0]
    message = f"the model step failed: {error}".splitlines()[0]  # (the log has its type and traceback)
    for record in records.values():
        core._end_sequences(record, record.sequences, SequenceStatus.FINISHED_ERROR)
        core._close(record, CoreError("internal", message))
    # KV written by the failed step may be garbage: never serve it from the prefix cache, and
    # idle sessions recompute their history.
    core.kv_cache.reset_prefix_cache()
    core.sessions.drop_all_kv()
