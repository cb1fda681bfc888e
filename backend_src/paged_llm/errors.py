"""Typed errors that cross the engine/serving boundary; the Triton adapter maps each to a status code."""

from __future__ import annotations


def wire_text(text: str) -> str:
    """`text` as it can go to a client: UTF-8 encodable (a lone surrogate a client sent, quoted back
    in a message, becomes its \\udXXX escape; pb_utils.TritonError and the wire reject it)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class InvalidRequestError(ValueError):
    """Bad user input (becomes INVALID_ARG). `field` names what the user must fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

    @classmethod
    def verbatim(cls, field: str, text: str) -> InvalidRequestError:
        """An error whose message is exactly `text` (where clients compare it, e.g. vllm_backend's)."""
        error = cls(field, text)
        error.args = (text,)
        return error


class SessionNotFoundError(LookupError):
    """A turn names a session that is not open: never opened, closed, or expired (becomes NOT_FOUND)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session_id: session {session_id!r} is not open (never started, closed, or expired after "
            "its idle TTL); start it with session_start"
        )
        self.session_id = session_id
        self.field = "session_id"

    @classmethod
    def with_message(cls, message: str) -> SessionNotFoundError:
        """The error rebuilt from its message (it crossed the engine core's process boundary)."""
        error = cls("")
        error.args = (f"session_id: {message}",)
        return error


class QueueFullError(RuntimeError):
    """The engine refuses the request for load (becomes UNAVAILABLE): the waiting queue is at
    `max_queued_requests`, `admission_policy` reject found it at capacity, or it waited longer than
    `queue_max_wait_s`. Retrying later may succeed."""


class EngineDeadError(RuntimeError):
    """The engine is not running (shutting down, or its core died) and takes no more work (becomes
    UNAVAILABLE)."""


class TensorParallelError(EngineDeadError):
    """The tensor-parallel ranks can no longer run a step together (the core stops; its requests end
    with the engine-dead error): rank 0 failed inside a step, so the workers wait in a collective
    that rank 0 left."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker process exited: its rank's share of the model is gone."""


class RequestAbortedError(RuntimeError):
    """The request was ended before it finished: client cancellation, timeout or shutdown
    (becomes CANCELLED). The message says which."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request: a model fault (becomes INTERNAL)."""


class EngineCoreDiedError(EngineStepError):
    """The engine core process died while this request was in flight (becomes INTERNAL)."""
