"""Typed errors that cross the engine/serving boundary; the Triton adapter maps each to a status code."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad user input (becomes INVALID_ARG). `field` names what the user must fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests` (becomes UNAVAILABLE)."""


class EngineDeadError(RuntimeError):
    """The engine stopped after a fault and takes no more work (becomes UNAVAILABLE)."""


class RequestAbortedError(RuntimeError):
    """The request was ended before it finished: client cancellation, timeout or shutdown
    (becomes CANCELLED). The message says which."""
