"""xgrammar structural tags (`{"type": "structural_tag", "format": ...}`, plain JSON; the engine core
compiles them: sent as `structured_outputs.structural_tag`) for what the chat route enforces:

- tool calls (`tool_choice` required: one call or more, several only with parallel_tool_calls;
  a named function: exactly one call of it), each in the tool-call parser's own format
  (tool_parsers.CallFormat) with the function's parameters schema as its arguments;
- a reasoning block before the constrained part, for a reasoning parser: the constraint holds the
  answer, not the thinking (reasoning.py says where the block starts).

JSON inside a structural tag allows any whitespace unless bounded; `max_whitespace_cnt` 1 keeps it
near the engine's compact JSON (the default) and stops a model from filling max_tokens with blanks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from paged_llm.openai.reasoning import THINK_CLOSE, THINK_OPEN, PromptThinkState, starts_in_reasoning
from paged_llm.openai.tool_parsers import CallFormat

Format = dict[str, Any]
COMPACT_WHITESPACE = 1
# What Qwen3 writes between </think> and its answer (as its template renders a past answer).
_AFTER_REASONING = {"qwen3": "\n\n", "deepseek_r1": ""}


def structural_tag(fmt: Format) -> Format:
    return {"type": "structural_tag", "format": fmt}


def json_format(schema: Any, compact: bool = True) -> Format:
    fmt: Format = {"type": "json_schema", "json_schema": schema}
    if compact:
        fmt["max_whitespace_cnt"] = COMPACT_WHITESPACE
    return fmt


def tool_calls_format(
    call_format: CallFormat, functions: Mapping[str, Any], at_least_one: bool, parallel: bool
) -> Format:
    """Calls of `functions` (name -> parameters schema) in `call_format`: one (a single function and
    no parallel calls), else one or more (`at_least_one`) joined by the format's separator."""
    tags = [
        {
            "type": "tag",
            "begin": call_format.begin(name),
            "content": json_format(parameters),
            "end": call_format.end,
        }
        for name, parameters in functions.items()
    ]
    if len(tags) == 1 and not parallel:
        return tags[0]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": call_format.separator,
        "at_least_one": at_least_one,
        "stop_after_first": not parallel,
    }


def constraint_format(kind: str, value: Any, compact: bool) -> Format:
    """A `structured_outputs` constraint (vLLM's keys; already validated) as a structural tag format."""
    if kind == "json":
        return json_format(json.loads(value) if isinstance(value, str) else value, compact)
    if kind == "json_object":
        return json_format({"type": "object"}, compact)
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    if kind == "choice":
        return {
            "type": "or",
            "elements": [{"type": "const_string", "value": c} for c in dict.fromkeys(value)],
        }
    if kind == "grammar":
        return {"type": "grammar", "grammar": value}
    if kind == "structural_tag":
        tag = json.loads(value) if isinstance(value, str) else value
        return tag.get("format", tag)
    raise ValueError(f"unknown constraint kind {kind!r}")


def reasoning_format(parser: str, state: PromptThinkState) -> Format | None:
    """The reasoning block the output starts with, None when it has none (the prompt closed it)."""
    inside = starts_in_reasoning(parser, state)
    if inside is False:
        return None
    block: Format = {
        "type": "tag",
        "begin": "" if inside else THINK_OPEN,
        "content": {"type": "any_text"},
        "end": THINK_CLOSE,
    }
    if _AFTER_REASONING[parser]:
        block = {
            "type": "sequence",
            "elements": [block, {"type": "const_string", "value": _AFTER_REASONING[parser]}],
        }
    # qwen3 after a prompt without <think>: the model may answer without thinking
    return block if inside else {"type": "optional", "content": block}


def after_reasoning(reasoning: Format | None, fmt: Format) -> Format:
    return fmt if reasoning is None else {"type": "sequence", "elements": [reasoning, fmt]}
