"""The session a generation request is a turn of, as its X-Session-* headers say."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from paged_llm.openai.errors import OpenAIError

SESSION_ID_HEADER = "x-session-id"
SESSION_START_HEADER = "x-session-start"
SESSION_END_HEADER = "x-session-end"


def session_of(request: Request) -> dict[str, Any] | None:
    """The session a request is a turn of, from its headers: X-Session-Id names it, X-Session-Start
    and X-Session-End (true/false, 1/0) open and close it. Its messages (or prompt) are then only
    the turn's new ones: the server keeps the conversation (core/sessions.py)."""
    session_id = request.headers.get(SESSION_ID_HEADER)
    flags = {}
    for name, header in (("session_start", SESSION_START_HEADER), ("session_end", SESSION_END_HEADER)):
        raw = request.headers.get(header)
        if raw is None:
            continue
        if raw.strip().lower() not in ("true", "false", "1", "0"):
            raise OpenAIError(400, f"header {header}: must be true or false, got {raw!r}", header)
        flags[name] = raw.strip().lower() in ("true", "1")
    if session_id is None:
        if flags:
            raise OpenAIError(
                400, f"{SESSION_START_HEADER} and {SESSION_END_HEADER} need {SESSION_ID_HEADER}"
            )
        return None
    return {"session_id": session_id, **flags}
