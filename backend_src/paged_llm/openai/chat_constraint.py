"""The constraint a chat request sends, decided once its prompt is rendered: the client's output
constraint (constraints.py) or the tool calls `tool_choice` enforces (tools.py), put after the
reasoning block when the server has a reasoning parser and the prompt leaves one to write
(structural_tags.py). A client's own structural tag is sent as it is: it says what the whole output
is. The result is a Constraint, so an error the engine sends about it names the client's field
(`tools` for the enforced calls).
"""

from __future__ import annotations

from paged_llm.openai.constraints import Constraint
from paged_llm.openai.reasoning import PromptThinkState
from paged_llm.openai.structural_tags import (
    after_reasoning,
    constraint_format,
    reasoning_format,
    structural_tag,
    tool_calls_format,
)
from paged_llm.openai.tool_parsers import CallFormat
from paged_llm.openai.tools import ToolUse


def chat_constraint(
    constraint: Constraint | None,
    tools: ToolUse | None,
    call_format: CallFormat | None,
    reasoning_parser: str | None,
    think_state: PromptThinkState,
) -> Constraint | None:
    reasoning = reasoning_format(reasoning_parser, think_state) if reasoning_parser else None
    if tools is not None and tools.enforced:
        assert call_format is not None
        calls = tool_calls_format(call_format, tools.functions, at_least_one=True, parallel=tools.parallel)
        spec = {"structural_tag": structural_tag(after_reasoning(reasoning, calls))}
        return Constraint("tools", spec, "structural_tag")
    if constraint is None or reasoning is None or constraint.kind == "structural_tag":
        return constraint
    answer = constraint_format(constraint.kind, constraint.value, constraint.compact)
    spec = {"structural_tag": structural_tag(after_reasoning(reasoning, answer))}
    return Constraint(constraint.field, spec, "structural_tag")
