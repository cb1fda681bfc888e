"""A chat choice's text as OpenAI's message: the reasoning split off (reasoning.py), tool calls read
out of the rest (tool_parsers.py), and both as streamed deltas or one message.

Streamed, a call's first delta carries its `id`, `type` and `function.name` with `arguments: ""`,
later ones fragments of its arguments; parsed whole or piece by piece the parts are the same, so the
deltas of a stream reassemble to the message the same text gives unstreamed. Reasoning goes to
`reasoning_content` and, as vLLM names it since 0.11, `reasoning` too.
"""

from __future__ import annotations

import uuid
from typing import Any

from paged_llm.openai.output_parts import Part
from paged_llm.openai.reasoning import ReasoningSplitter
from paged_llm.openai.tool_parsers import ToolCallParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceOutput:
    """One choice's text through its parsers: parts as the text streams in."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.call_ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def feed(self, text: str) -> list[Part]:
        parts = self.reasoning.feed(text) if self.reasoning else [Part("content", text)]
        return self._through_tools(parts, final=False)

    def finish(self) -> list[Part]:
        parts = self.reasoning.finish() if self.reasoning else []
        return self._through_tools(parts, final=True)

    def _through_tools(self, parts: list[Part], final: bool) -> list[Part]:
        if self.tools is None:
            return parts
        out: list[Part] = []
        for part in parts:
            if part.kind == "content":  # (tool calls are read from the answer, not the reasoning)
                out.extend(self.tools.feed(part.text))
            else:
                out.append(part)
        if final:
            out.extend(self.tools.finish())
        self.call_ids.extend(new_call_id() for part in out if part.kind == "call")
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for a choice that called tools and ended on its own; a cut one keeps `length`."""
        return "tool_calls" if reason == "stop" and self.call_ids else reason


def deltas(parts: list[Part], call_ids: list[str]) -> list[dict[str, Any]]:
    """The chunk deltas of `parts`, in order (adjacent text of one kind merged)."""
    out: list[dict[str, Any]] = []
    for part in parts:
        last = out[-1] if out else None
        if part.kind == "content":
            if last is not None and last.keys() == {"content"}:
                last["content"] += part.text
            else:
                out.append({"content": part.text})
        elif part.kind == "reasoning":
            if last is not None and "reasoning" in last:
                last["reasoning_content"] += part.text
                last["reasoning"] += part.text
            else:
                out.append({"reasoning_content": part.text, "reasoning": part.text})
        elif part.kind == "call":
            call = {"index": part.index, "id": call_ids[part.index], "type": "function"}
            out.append({"tool_calls": [{**call, "function": {"name": part.text, "arguments": ""}}]})
        else:
            calls = last.get("tool_calls") if last is not None else None
            if calls and "id" not in calls[0] and calls[0]["index"] == part.index:
                calls[0]["function"]["arguments"] += part.text
            else:
                out.append({"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]})
    return out


def message(parts: list[Part], call_ids: list[str], with_reasoning: bool) -> dict[str, Any]:
    """The assistant message of a whole choice's parts (content null when there is no text)."""
    texts: dict[str, list[str]] = {"content": [], "reasoning": []}
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for part in parts:
        if part.kind == "call":
            names[part.index] = part.text
            arguments[part.index] = []
        elif part.kind == "arguments":
            arguments[part.index].append(part.text)
        else:
            texts[part.kind].append(part.text)
    result: dict[str, Any] = {"role": "assistant", "content": "".join(texts["content"]) or None}
    if with_reasoning:
        reasoning = "".join(texts["reasoning"]) or None
        result["reasoning_content"] = reasoning
        result["reasoning"] = reasoning
    if names:
        result["tool_calls"] = [
            {
                "id": call_ids[index],
                "type": "function",
                "function": {"name": name, "arguments": "".join(arguments[index])},
            }
            for index, name in sorted(names.items())
        ]
    return result
