"""The engine core's table of client requests: each request's sequences, which request and sample
a live sequence belongs to, and how a request's sequences end and the request closes.

EngineCore, request expiry (expiry.py) and step faults (faults.py) all end requests through it, so
the record and the owner map stay in step whoever ends them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from paged_llm.core.scheduler import Scheduler
from paged_llm.core.sessions import SessionManager, SessionTurn
from paged_llm.engine.core_types import CoreError, EngineCoreOutputs, FinishedRequest, FinishedSequence
from paged_llm.sequence import Sequence, SequenceStatus

logger = logging.getLogger("paged_llm.engine.engine_core.core")  # its lines were the core's: same logger


@dataclass
class CoreRequest:
    """The core's record of one client request: its sequences, started or waiting to start."""

    request_id: str
    sequences: list[Sequence]  # started; index in this list = the sample's index
    unstarted: list[Sequence]  # samples 1..n-1, started once sample 0 computed the prompt
    deadline: float | None
    arrival_time: float
    reported_finished: set[int] = field(default_factory=set)  # indices whose end was published
    session: SessionTurn | None = None
    parked: Sequence | None = None  # sample 0 while the request waits to start (for its grammar)

    @property
    def num_samples(self) -> int:
        return len(self.sequences) + len(self.unstarted) + (self.parked is not None)

    @property
    def is_finished(self) -> bool:
        return len(self.reported_finished) == self.num_samples


class RequestTable:
    """`outputs()`: what the current step publishes (the core replaces it after every step)."""

    def __init__(
        self, scheduler: Scheduler, sessions: SessionManager, outputs: Callable[[], EngineCoreOutputs]
    ) -> None:
        self.scheduler = scheduler
        self.sessions = sessions
        self._outputs = outputs
        self._requests: dict[str, CoreRequest] = {}
        self._owner: dict[str, tuple[CoreRequest, int]] = {}  # live sequence id -> (request, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[CoreRequest]:
        return iter(list(self._requests.values()))

    def get(self, request_id: str) -> CoreRequest | None:
        return self._requests.get(request_id)

    def owner(self, seq_id: str) -> tuple[CoreRequest, int] | None:
        """The request a live sequence belongs to, and its sample index."""
        return self._owner.get(seq_id)

    def add(self, record: CoreRequest, first: Sequence, parked: bool = False) -> None:
        """`parked`: the request waits (for its grammar); `start_parked` starts it later."""
        self._requests[record.request_id] = record
        if parked:
            record.parked = first
        else:
            self.start(record, first)

    def start_parked(self, record: CoreRequest) -> None:
        assert record.parked is not None, f"request {record.request_id} is not parked"
        first, record.parked = record.parked, None
        self.start(record, first)

    def start(self, record: CoreRequest, seq: Sequence) -> None:
        self._owner[seq.seq_id] = (record, len(record.sequences))
        record.sequences.append(seq)
        self.scheduler.add_sequence(seq)

    def start_siblings(self, record: CoreRequest) -> None:
        first = record.sequences[0]
        for seq in record.unstarted:
            seq.arrival_seq = first.arrival_seq  # same place in the queue as the first sample
            self.start(record, seq)
        record.unstarted = []

    def abort(self, request_id: str, seq_index: int | None = None, reason: str = "cancelled") -> None:
        """Ends a request (or one of its sequences) now; what ended is published by the next step()."""
        record = self._requests.get(request_id)
        if record is None:
            return
        if seq_index is not None:
            if seq_index < len(record.sequences):
                self.end_sequences(record, [record.sequences[seq_index]], SequenceStatus.FINISHED_ABORTED)
            if record.is_finished:
                self.close(record)
            return
        live = [s for s in record.sequences if not s.is_finished]
        logger.info(
            "request %s aborted (%s) while %s, after %d generated tokens",
            request_id,
            reason,
            "/".join(sorted({s.status.value for s in live})) or "finished",
            sum(s.num_output_tokens - s.num_pending_tokens for s in record.sequences),
        )
        self.end_sequences(record, record.sequences, SequenceStatus.FINISHED_ABORTED)
        self.close(record, CoreError("aborted", reason))

    def end_sequences(self, record: CoreRequest, seqs: list[Sequence], status: SequenceStatus) -> None:
        """Finishes live sequences (abort, fault) and publishes their end."""
        live = [s for s in seqs if not s.is_finished]
        self.scheduler.finish_sequences([s.seq_id for s in live], status)
        for seq in live:
            _record, index = self._owner.pop(seq.seq_id)
            record.reported_finished.add(index)
            self._outputs().finished_sequences.append(
                FinishedSequence(record.request_id, index, status.finish_reason or "abort")
            )

    def finished(self, record: CoreRequest, index: int) -> None:
        """Sample `index` ended in the scheduler (stop, length): its end is being published."""
        del self._owner[record.sequences[index].seq_id]
        record.reported_finished.add(index)

    def close(self, record: CoreRequest, error: CoreError | None = None) -> None:
        """Forgets a request whose sequences all ended (or that failed) and publishes that."""
        del self._requests[record.request_id]
        for seq in record.sequences:
            self._owner.pop(seq.seq_id, None)
        record.unstarted = []
        record.parked = None
        if record.session is not None:
            self.sessions.end_turn(
                record.session.session_id, record.sequences[0] if record.sequences else None
            )
        self._outputs().finished_requests.append(FinishedRequest(record.request_id, error))

    def check_integrity(self) -> None:
        live = {s.seq_id for r in self._requests.values() for s in r.sequences if not s.is_finished}
        assert live == set(self.scheduler.sequences), "requests and scheduler disagree on live sequences"
        assert set(self._owner) == live, "owner map out of sync"
        for record in self._requests.values():
            assert not record.is_finished, f"request {record.request_id} finished but not closed"
