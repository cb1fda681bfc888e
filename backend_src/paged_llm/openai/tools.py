"""Tool calling on /v1/chat/completions, the request's side: `tools`, `tool_choice` and
`parallel_tool_calls` checked (400s naming `tools[i].function...` or `tool_choice`), and the tool
calls of past assistant messages made ready for the chat template.

  tool_choice  none      tools rendered (as vLLM does), nothing parsed
               auto      (the default with tools) the parser reads the calls the model wrote; needs
                         --enable-auto-tool-choice and --tool-call-parser, as in vLLM
               required  a grammar holds the output to one or more calls (several only with
                         parallel_tool_calls), each's arguments to the function's parameters
               {"type": "function", "function": {"name": N}}  exactly one call of N, enforced so

What the grammar and the parser share is the parser's format (tool_parsers.py); required and a named
function use --tool-call-parser's, or hermes's where the server has none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from paged_llm.errors import InvalidRequestError
from paged_llm.openai.errors import OpenAIError, bad_request
from paged_llm.openai.tool_parsers import TOOL_CALL_PARSERS, HermesParser, ToolCallParser
from paged_llm.structured_output_params import check_json_schema

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A function without `parameters` takes none (OpenAI): its arguments are {}.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (every call is held to the parameters when enforced; none otherwise)


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


@dataclass(frozen=True)
class ToolUse:
    choice: str  # none | auto | required | function (a named one)
    functions: dict[str, Any]  # name -> parameters schema of what the output may call
    parallel: bool
    template_tools: list[dict[str, Any]] = field(default_factory=list)  # what the template renders

    @property
    def enforced(self) -> bool:
        """A grammar holds the output to tool calls."""
        return self.choice in ("required", "function")


def tool_use(
    tools: list[ToolDefinition] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolUse | None:
    """The request's tools checked, None without any."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    functions: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}].function"
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise bad_request(
                f"{where}.name: {name!r} is not a function name (1 to 64 of a-z, A-Z, 0-9, _ and -)",
                f"{where}.name",
            )
        if name in functions:
            raise bad_request(f"{where}.name: a second function named {name!r}", f"{where}.name")
        parameters = tool.function.parameters
        if parameters is not None:
            try:
                check_json_schema(parameters, f"{where}.parameters")
            except InvalidRequestError as error:
                raise bad_request(str(error), error.field) from None
        functions[name] = parameters if parameters is not None else NO_PARAMETERS
    choice, named = _choice(tool_choice if tool_choice is not None else "auto")
    if named is not None:
        if named not in functions:
            raise bad_request(
                f"tool_choice names function {named!r}, which is not in tools ({', '.join(functions)})",
                "tool_choice",
            )
        functions = {named: functions[named]}
    parallel = parallel_tool_calls is not False and named is None
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    return ToolUse(choice, functions, parallel, rendered)


def _choice(raw: Any) -> tuple[str, str | None]:
    if raw in ("none", "auto", "required"):
        return raw, None
    if (
        isinstance(raw, dict)
        and raw.get("type") == "function"
        and isinstance(raw.get("function"), dict)
        and isinstance(raw["function"].get("name"), str)
        and raw.keys() == {"type", "function"}
    ):
        return "function", raw["function"]["name"]
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def call_parser(use: ToolUse, parser: str | None, enable_auto: bool) -> type[ToolCallParser] | None:
    """The parser of the request's calls (None: nothing is parsed), or vLLM's 400 for `auto` on a
    server without --enable-auto-tool-choice and --tool-call-parser."""
    if use.choice == "none":
        return None
    if use.choice == "auto" and not (enable_auto and parser):
        raise OpenAIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
    return TOOL_CALL_PARSERS[parser or HermesParser.name]


def history_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates take them: each call's arguments, a
    JSON string in OpenAI's API, parsed to an object (as vLLM passes them)."""
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list of tool calls", where)
    calls = []
    for index, call in enumerate(raw):
        place = f"{where}[{index}].function"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{place} must be an object with a name", place)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise bad_request(f"{place}.arguments is not valid JSON", f"{place}.arguments") from None
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return calls
