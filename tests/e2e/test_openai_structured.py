"""Structured output, tool calling and reasoning through the OpenAI server end to end, driven by the
official `openai` SDK: `paged-llm serve` on the tiny model (real tritonserver) with a Hermes-style
chat template that renders tools, --tool-call-parser hermes --enable-auto-tool-choice
--reasoning-parser qwen3; and a second OpenAI server on the same tritonserver with a template that
opens <think> in the prompt, --tool-call-parser llama3_json --reasoning-parser deepseek_r1.

The tiny model's weights are random: only the grammar makes its output valid, so every parsed object,
call and split below is the constraint's doing.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from paged_llm.testing.server_process import free_ports, stop_process_group, wait_until_healthy
from tests.e2e.test_openai import _start_openai_server

pytestmark = pytest.mark.timeout(300)
MODEL = "llm"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Qwen3's tool prompt, trimmed: tools in the system turn, calls as <tool_call> JSON, results as
# <tool_response>; enable_thinking false closes an empty think block in the prompt, as Qwen3's does.
HERMES_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": '
    + (tool_call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
# DeepSeek-R1 style: the generation prompt opens <think> (closed and empty without thinking).
R1_TEMPLATE = """
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n<think>\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@dataclass
class Servers:
    qwen: openai.OpenAI  # paged-llm serve: hermes, auto tool choice, qwen3
    r1: openai.OpenAI  # second OpenAI server: llama3_json (no auto), deepseek_r1


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("openai_structured")
    (root / "hermes.jinja").write_text(HERMES_TEMPLATE)
    (root / "r1.jinja").write_text(R1_TEMPLATE)
    port, http_port, grpc_port, metrics_port = free_ports(4)
    log_path = root / "serve.log"
    command = [
        sys.executable, "-m", "paged_llm.cli", "serve", "tiny-qwen3",
        "--port", str(port), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--model-repository-dir", str(root / "models"),
        "--openai-workers", "1", "--chat-template", str(root / "hermes.jinja"),
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_healthy(f"{base_url}/health", process, log_path)
        r1_server, r1_url = _start_openai_server(
            f"127.0.0.1:{grpc_port}", root / "r1_server.log", "--chat-template", str(root / "r1.jinja"),
            "--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1",
        )  # fmt: skip
        try:
            yield Servers(_client(base_url), _client(r1_url))
        finally:
            stop_process_group(r1_server, signal.SIGTERM)
    finally:
        stop_process_group(process)


# ----------------------------------------------------------------------------------- structured output
class Place(BaseModel):
    city: Literal["Oslo", "Rome", "Lima"]
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


class Forecast(BaseModel):
    place: Place  # pydantic writes it as $defs + $ref
    temperature: int = Field(ge=-40, le=45)
    sunny: bool
    warning: Literal["wind", "rain"] | None  # anyOf with null


def test_parse_with_a_pydantic_model(servers):
    completion = servers.qwen.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        response_format=Forecast,
        max_tokens=100,
        temperature=0,
        extra_body=NO_THINKING,
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content) == choice.message.parsed
    assert choice.message.reasoning_content is None  # the prompt closed the think block


def test_json_object_and_json_schema_on_both_routes(servers):
    client = servers.qwen
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=40, seed=5,
        extra_body=NO_THINKING,
    )  # fmt: skip
    text = chat.choices[0].message.content
    # (random weights seldom close a free string within max_tokens: an object, or the start of one)
    assert isinstance(json.loads(text), dict) if chat.choices[0].finish_reason == "stop" else text[:2] == '{"'
    completion = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=100, temperature=0, n=2, seed=3,
        extra_body={"response_format": _format(WEATHER_PARAMETERS)},
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), WEATHER_PARAMETERS)
    guided = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={"guided_json": WEATHER_PARAMETERS},
    )
    jsonschema.validate(json.loads(guided.choices[0].text), WEATHER_PARAMETERS)


@pytest.mark.parametrize(
    ("extra", "matches"),
    [
        ({"structured_outputs": {"regex": "[a-c]{2,5}x"}}, lambda t: len(t) in range(3, 7) and t[-1] == "x"),
        ({"guided_regex": "[0-9]{3}-[0-9]{2}"}, lambda t: t[:3].isdigit() and t[3] == "-" and len(t) == 6),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda t: t in ("yes", "no", "maybe")),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_grammar": 'root ::= "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
    ],
)
def test_regex_choice_and_grammar_outputs_match_exactly(servers, extra, matches):
    client = servers.qwen
    completion = client.completions.create(
        model=MODEL, prompt="Say:", max_tokens=20, n=2, seed=1, extra_body=extra
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, seed=2, extra_body={**extra, **NO_THINKING}
    )
    streamed = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, seed=2, stream=True, extra_body={**extra, **NO_THINKING}
    )
    texts = [c.text for c in completion.choices] + [chat.choices[0].message.content]
    assert all(matches(text) for text in texts), texts
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert {c.finish_reason for c in completion.choices} | {chat.choices[0].finish_reason} == {"stop"}


# ----------------------------------------------------------------------------------- tool calls
def _call_tuple(call: Any) -> tuple[str, str]:
    return call.function.name, call.function.arguments


def _streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """(name, arguments) per call, the content and the finish reason a client rebuilds from a stream,
    checking that each call's first delta has its id, type and name."""
    calls: dict[int, list[str]] = {}
    content, reason = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
    return [(name, arguments) for name, arguments in calls.values()], content or None, reason


def test_required_tool_call_round_trip(servers, tiny_tokenizer):
    client = servers.qwen
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, seed=7, extra_body=NO_THINKING,
    )  # fmt: skip
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    # the call and its result go back in the history: the template renders the arguments as an object
    history = [
        *ASK,
        choice.message,  # as the SDK's users append it
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert second.choices[0].message.tool_calls is None  # tool_choice none: nothing parsed
    as_object = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    rendered = tiny_tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [as_object]}, history[2]],
        tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert f'"arguments": {json.dumps(arguments)}' in rendered
    assert second.usage.prompt_tokens == len(tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [(NAMED, True), ("required", True)],
)
def test_streamed_tool_call_deltas_reassemble_to_the_unstreamed_calls(servers, tool_choice, parallel):
    request = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
        max_tokens=150, temperature=1.0, seed=11, extra_body=NO_THINKING,
    )  # fmt: skip
    whole = servers.qwen.chat.completions.create(**request)
    calls, content, reason = _streamed_calls(servers.qwen.chat.completions.create(**request, stream=True))
    [choice] = whole.choices
    assert calls == [_call_tuple(c) for c in choice.message.tool_calls] and calls
    assert (content, reason) == (choice.message.content, choice.finish_reason)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_weather"] and reason == "tool_calls"
        jsonschema.validate(json.loads(calls[0][1]), WEATHER_PARAMETERS)


def test_auto_parses_the_calls_the_model_writes_and_leaves_text_alone(servers):
    # (random weights never write a call unasked: an extra-body choice makes it write one)
    written = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    request = dict(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"choice": [written]}, **NO_THINKING},
    )  # fmt: skip
    whole = servers.qwen.chat.completions.create(**request)
    [choice] = whole.choices
    assert [_call_tuple(c) for c in choice.message.tool_calls] == [("get_time", '{"zone":"CET"}')]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert _streamed_calls(servers.qwen.chat.completions.create(**request, stream=True)) == (
        [("get_time", '{"zone":"CET"}')], None, "tool_calls",
    )  # fmt: skip
    text = servers.qwen.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert text.choices[0].finish_reason == "length"


def test_llama3_json_calls_and_auto_needs_the_flag(servers):
    named = servers.r1.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, extra_body=NO_THINKING,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    with pytest.raises(openai.BadRequestError) as info:
        servers.r1.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
    assert info.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in info.value.body["message"]


# ----------------------------------------------------------------------------------- reasoning
def _streamed_split(stream: Any) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    return reasoning or None, content or None


def _text(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _letters(low: int, high: int) -> dict[str, Any]:
    return {"type": "regex", "pattern": f"[a-z]{{{low},{high}}}"}


def _forced(*elements: dict[str, Any]) -> dict[str, Any]:
    """An extra body whose structural tag writes the output (the client's own: sent as it is)."""
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": list(elements)}}
    return {"structured_outputs": {"structural_tag": tag}}


def test_qwen3_reasoning_content_split(servers):
    request = dict(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0,
        extra_body=_forced(_text("<think>"), _letters(3, 6), _text("</think>\n\n"), _letters(2, 5)),
    )  # fmt: skip
    message = servers.qwen.chat.completions.create(**request).choices[0].message
    assert message.reasoning_content.isalpha() and message.reasoning == message.reasoning_content
    assert message.content.startswith("\n\n") and message.content.strip().isalpha()
    assert _streamed_split(servers.qwen.chat.completions.create(**request, stream=True)) == (
        message.reasoning_content, message.content,
    )  # fmt: skip
    # the model did not open a think block: all content
    plain = servers.qwen.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, extra_body=_forced(_letters(4, 4))
    ).choices[0].message  # fmt: skip
    assert plain.reasoning_content is None and len(plain.content) == 4


def test_deepseek_r1_reasoning_content_split(servers):
    request = dict(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0,
        extra_body=_forced(_letters(3, 6), _text("</think>"), _letters(2, 5)),
    )  # fmt: skip
    message = servers.r1.chat.completions.create(**request).choices[0].message
    assert message.reasoning_content.isalpha() and message.content.isalpha()
    assert _streamed_split(servers.r1.chat.completions.create(**request, stream=True)) == (
        message.reasoning_content, message.content,
    )  # fmt: skip
    # no </think> before max_tokens: all reasoning
    cut = servers.r1.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    assert cut.choices[0].message.reasoning_content


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": _format({"type": "object", "properties": {"a": {"type": "nope"}}})},
         "response_format.json_schema.schema/properties/a/type", "not a valid JSON Schema"),
        ({"response_format": _format({"type": "array", "uniqueItems": True})},
         "response_format.json_schema.schema/uniqueItems", "unsupported JSON Schema keyword"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex", "Regex"),
        ({"extra_body": {"guided_regex": "a(b"}, "stream": True}, "guided_regex", "Regex"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "at least one choice"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name",
         "Missing"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
         "tool_choice", "'get_date', which is not in tools"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
         "response_format and guided_regex were both given"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "tool_choice and response_format"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(servers, fields, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        result = servers.qwen.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
        list(result)  # (a stream's error comes as its HTTP status, before any event)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param and words in error["message"], error
    assert "Traceback" not in error["message"] and error["type"] == "invalid_request_error"


def test_a_regex_that_does_not_compile_on_completions_names_the_field(servers):
    with pytest.raises(openai.BadRequestError) as info:
        servers.qwen.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "[z-a]"}
        )
    assert info.value.body["param"] == "guided_regex" and info.value.body["message"].startswith(
        "guided_regex: "
    )
    ok = servers.qwen.completions.create(
        model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-z]+"}
    )
    assert ok.choices[0].text.isalpha()  # and the server serves on
