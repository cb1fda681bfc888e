"""Step-failure handling: a model step that raised fails the requests it carried (INTERNAL), drops
KV that may be garbage and lets the core keep serving; a step launched on a failed step's KV fails
with it."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.scheduler import ScheduledSequence
from paged_llm.core.sessions import SessionManager
from paged_llm.engine.core_types import CoreError
from paged_llm.engine.engine_core.request_table import CoreRequest, RequestTable
from paged_llm.runner.step_types import LaunchedStep
from paged_llm.sequence import SequenceStatus

logger = logging.getLogger(__name__)


class StepFaults:
    """Fails the requests of model steps that raised, and counts those steps. `check_workers`:
    raises WorkerDiedError when a tensor-parallel worker died (the runner's check_workers)."""

    def __init__(
        self,
        requests: RequestTable,
        kv_cache: KVCacheManager,
        sessions: SessionManager,
        check_workers: Callable[[], None],
    ) -> None:
        self.requests = requests
        self.kv_cache = kv_cache
        self.sessions = sessions
        self.check_workers = check_workers
        self.num_step_faults = 0

    def fail_launched_after_fault(
        self, launched: LaunchedStep, scheduled: list[ScheduledSequence], step_number: int
    ) -> None:
        """Step N failed with N+1 already launched: N+1 read N's KV and may have read prefix-cache
        blocks that N was writing (they count as computed from launch on), so its requests fail too."""
        try:
            launched.result()
        except Exception:  # the device fault shows here as well; the step fails either way
            pass
        self.fail_step(
            scheduled,
            RuntimeError(f"launched before step {step_number - 1} failed, on its KV"),
            step_number,
            is_fault=False,
        )

    def fail_step(
        self,
        scheduled: list[ScheduledSequence],
        error: Exception,
        step_number: int,
        is_fault: bool = True,
    ) -> None:
        """A model fault: fail every request of the step (INTERNAL), drop cached KV, keep serving.
        `is_fault=False`: the step failed because of another step's fault (not counted again).
        A collective that failed because a tensor-parallel worker died raises WorkerDiedError."""
        self.check_workers()
        logger.error(
            "model step %d failed; failing %d sequences:\n%s",
            step_number,
            len(scheduled),
            "".join(traceback.format_exception(error)),
        )
        self.num_step_faults += int(is_fault)
        records: dict[int, CoreRequest] = {}
        for item in scheduled:
            owner = None if item.seq.is_finished else self.requests.owner(item.seq_id)
            # The id may belong to a newer request by now (aborted, then reused): match the object.
            if owner is not None and owner[0].sequences[owner[1]] is item.seq:
                records[id(owner[0])] = owner[0]
        message = f"the model step failed: {error}".splitlines()[0]  # (the log has its type and traceback)
        for record in records.values():
            self.requests.end_sequences(record, record.sequences, SequenceStatus.FINISHED_ERROR)
            self.requests.close(record, CoreError("internal", message))
        # KV written by the failed step may be garbage: never serve it from the prefix cache, and
        # idle sessions recompute their history.
        self.kv_cache.reset_prefix_cache()
        self.sessions.drop_all_kv()
