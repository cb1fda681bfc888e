"""What a chat choice's generated text is made of once parsed: content, reasoning, tool calls. The
parsers (reasoning.py, tool_parsers.py) turn text into parts as it streams; chat_output.py turns
parts into OpenAI deltas and messages."""

from __future__ import annotations

from typing import Literal, NamedTuple

PartKind = Literal["content", "reasoning", "call", "arguments"]


class Part(NamedTuple):
    kind: PartKind
    text: str  # content or reasoning text, a call's function name, or a fragment of its arguments
    index: int = -1  # the call's index in the choice (call and arguments parts)


def content(text: str) -> list[Part]:
    return [Part("content", text)] if text else []
