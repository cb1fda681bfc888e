"""Request expiry: ends requests past their deadline (request timeout) and requests that waited in the
queue longer than queue_max_wait_s without starting, through the core's request table.
EngineCore.launch_step runs both before it schedules."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from paged_llm.engine.core_types import CoreError
from paged_llm.engine.engine_core.request_table import RequestTable
from paged_llm.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def expire_deadlines(requests: RequestTable) -> None:
    now = time.monotonic()
    expired = [r for r in requests if r.deadline is not None and r.deadline <= now]
    for record in expired:
        waited = now - record.arrival_time
        requests.abort(record.request_id, reason=f"timed out after {waited:.3f} s (request timeout)")


def expire_queue_waits(requests: RequestTable, waiting: Iterable[Sequence], max_wait_s: float) -> None:
    """Ends requests that waited longer than queue_max_wait_s without starting (UNAVAILABLE);
    a preempted sequence waits again, but it has run, so it is not counted as queued. `waiting`:
    the scheduler's waiting queue (only that, not every request)."""
    now = time.monotonic()
    expired = []
    for seq in waiting:
        owner = requests.owner(seq.seq_id)
        if owner is None or seq.first_scheduled_time is not None:
            continue
        record, index = owner
        if index == 0 and now - record.arrival_time > max_wait_s:
            expired.append(record)
    for record in expired:
        waited_s = now - record.arrival_time
        logger.info("request %s never started within queue_max_wait_s (%.3f s)", record.request_id, waited_s)
        requests.end_sequences(record, record.sequences, SequenceStatus.FINISHED_ABORTED)
        requests.close(
            record,
            CoreError(
                "unavailable",
                f"waited {waited_s:.3f} s in the queue without starting, more than "
                f"queue_max_wait_s={max_wait_s:g}; retry later",
            ),
        )
