"""Tool calling in the OpenAI server, its pure parts: tools / tool_choice / history checked with 400s
naming the field, the hermes and llama3_json parsers (whole and streamed: the deltas of any chunking
reassemble to the non-streamed message), and the chat deltas OpenAI's clients read."""

from __future__ import annotations

import itertools
import json
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.openai.chat_output import ChoiceOutput, deltas, message
from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.protocol import ChatCompletionRequest, parse_body
from paged_llm.openai.tool_parsers import HermesParser, Llama3JsonParser, ToolCallParser
from paged_llm.openai.tools import AUTO_NEEDS_FLAGS, NO_PARAMETERS, call_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_body(json.dumps(body).encode(), ChatCompletionRequest)


def _error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        request = _chat(**fields)
        for index, chat_message in enumerate(request.messages):
            chat_message.template_dict(index)
    assert info.value.status_code == 400
    return info.value


# ----------------------------------------------------------------------------------- the request
def test_tools_default_to_auto_and_a_function_without_parameters_takes_none():
    use = _chat(tools=[WEATHER, TIME]).tool_use
    assert use is not None and use.choice == "auto" and use.parallel and not use.enforced
    assert use.functions == {"get_weather": WEATHER["function"]["parameters"], "get_time": NO_PARAMETERS}
    assert use.template_tools == [WEATHER, TIME]  # what the chat template renders, as given
    assert _chat(tools=[WEATHER], tool_choice="none").tool_use.choice == "none"


def test_required_and_a_named_function_are_enforced_and_parallel_calls_follow_the_flag():
    required = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_use
    assert (
        required.enforced and not required.parallel and set(required.functions) == {"get_weather", "get_time"}
    )
    named = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tool_use.enforced and named.tool_use.functions == {"get_time": NO_PARAMETERS}
    assert not named.tool_use.parallel  # exactly one call


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "Missing required"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "not a function",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools[0].function.name",
            "1 to 64",
        ),
        ({"tools": [TIME, TIME]}, "tools[1].function.name", "a second function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "Invalid value"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
            "Unrecognized",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters/type",
            "not a valid JSON Schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"uniqueItems": True}}}]},
            "tools[0].function.parameters/uniqueItems",
            "unsupported JSON Schema keyword",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
            "'get_time', which is not in tools (get_weather)",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "tool_choice and response_format were both given",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tools and"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
            "tool_choice and guided_regex",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}
                ]
            },
            "messages[0].tool_calls[0].function",
            "with a name",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]},
            "messages[0].tool_calls",
            "a list",
        ),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(fields, param, words):
    error = _error(**fields)
    assert error.param == param and words in error.message, (error.param, error.message)


def test_auto_needs_the_server_flags_as_in_vllm_and_none_parses_nothing():
    auto = _chat(tools=[WEATHER]).tool_use
    for parser, enabled in ((None, False), ("hermes", False), (None, True)):
        with pytest.raises(OpenAIError) as info:
            call_parser(auto, parser, enabled)
        assert (info.value.param, info.value.message) == ("tool_choice", AUTO_NEEDS_FLAGS)
    assert call_parser(auto, "llama3_json", True) is Llama3JsonParser
    assert call_parser(_chat(tools=[WEATHER], tool_choice="none").tool_use, "hermes", True) is None
    # an enforced call needs no flag: its format is the parser's, or hermes's without one
    required = _chat(tools=[WEATHER], tool_choice="required").tool_use
    assert call_parser(required, None, False) is HermesParser
    assert call_parser(required, "llama3_json", False) is Llama3JsonParser


def test_history_tool_calls_reach_the_template_with_their_arguments_parsed():
    request = _chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assistant = request.messages[1].template_dict(1)
    assert assistant["content"] == "" and [c["function"]["arguments"] for c in assistant["tool_calls"]] == [
        {"city": "Oslo"},
        {},
    ]
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert request.messages[2].template_dict(2) == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "sunny",
    }


# ----------------------------------------------------------------------------------- the parsers
def _parse(parser: type[ToolCallParser], text: str) -> dict[str, Any]:
    output = ChoiceOutput(None, parser())
    return message(output.feed(text) + output.finish(), output.call_ids, False)


def _calls(result: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in result.get("tool_calls", [])]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (
            'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            "\n</tool_call>",
            "Let me check.",
            [("get_weather", '{"city":"Oslo"}')],
        ),
        (
            '<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
            None,
            [("a", '{"x":[1,2]}'), ("b", "{}")],
        ),
        # keys in another order: parsed once complete, arguments serialized compact
        ('<tool_call>{"arguments": {"q": "é"}, "name": "f"}</tool_call>', None, [("f", '{"q":"é"}')]),
        # not a call: the text stays content
        ("<tool_call>not json</tool_call> then", "<tool_call>not json</tool_call> then", []),
        ("a <tool_", "a <tool_", []),
        # cut by max_tokens inside the arguments: the call keeps what was written
        ('<tool_call>\n{"name": "f", "arguments": {"q": "ab', None, [("f", '{"q":"ab')]),
        # no closing brace before the closing tag: the arguments end at the tag
        ('<tool_call>{"name": "f", "arguments": {"q": 1</tool_call>x', "x", [("f", '{"q":1')]),
        # whitespace outside strings goes, inside stays
        (
            '<tool_call>{"name": "f", "arguments": {\n "q" :\t"a  b" }}</tool_call>',
            None,
            [("f", '{"q":"a  b"}')],
        ),
    ],
)
def test_hermes(text, content, calls):
    result = _parse(HermesParser, text)
    assert (result["content"], _calls(result)) == (content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [("get_weather", '{"city":"Oslo"}')],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
            None,
            [("a", '{"x":1}'), ("b", "{}")],
        ),
        ('{"parameters": {"x": true}, "name": "a"}', None, [("a", '{"x":true}')]),
        ("The answer is 4.", "The answer is 4.", []),
        ('{"answer": 4}', '{"answer": 4}', []),  # JSON that is not a call
        ('Call {"name": "a", "parameters": {}}', 'Call {"name": "a", "parameters": {}}', []),
        ('{"name": "a", "parameters": {}} and more', "and more", [("a", "{}")]),
        ('{"name": "a", "parameters": {}}; ', None, [("a", "{}")]),
        ('{"name": "a", "parameters": {"x": ', None, [("a", '{"x":')]),  # cut by max_tokens
    ],
)
def test_llama3_json(text, content, calls):
    result = _parse(Llama3JsonParser, text)
    assert (result["content"], _calls(result)) == (content, calls)


def _streamed(parser: type[ToolCallParser], pieces: list[str]) -> tuple[list[dict[str, Any]], ChoiceOutput]:
    output = ChoiceOutput(None, parser())
    chunks: list[dict[str, Any]] = []
    for piece in pieces:
        chunks += deltas(output.feed(piece), output.call_ids)
    chunks += deltas(output.finish(), output.call_ids)
    return chunks, output


def _reassembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from the deltas (as the SDK's stream helpers do), checking their shape:
    a call's first delta has its id, type, name and empty arguments, later ones arguments only."""
    content, calls = "", {}
    for delta in chunks:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            index = call["index"]
            if index not in calls:
                assert index == len(calls)  # calls arrive in order
                assert call["type"] == "function" and call["id"].startswith("call_")
                assert call["function"]["arguments"] == "" and call["function"]["name"]
                calls[index] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            else:
                assert call.keys() == {"index", "function"} and call["function"].keys() == {"arguments"}
                calls[index]["arguments"] += call["function"]["arguments"]
    return {"content": content or None, "calls": [(c["name"], c["arguments"]) for c in calls.values()]}


def test_streamed_calls_come_as_openai_deltas():
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    chunks, output = _streamed(HermesParser, [text[:7], text[7:30], text[30:50], text[50:]])
    assert chunks[0] == {"content": "Sure."}
    assert chunks[1] == {
        "tool_calls": [
            {
                "index": 0,
                "id": output.call_ids[0],
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert _reassembled(chunks) == {"content": "Sure.", "calls": [("get_weather", '{"city":"Oslo"}')]}
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


# Fragments that make the parsers' states meet at chunk boundaries.
_FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<|py", "{", "}", "[", "]", '"',
    "\\", ":", ",", ";", " ", "\n", "a", "é", "1", '{"name": "f", "arguments": ',
    '{"name": "g", "parameters": ', '"name"', '"arguments"', "true", "null",
    '<tool_call>\n{"name": "f", "arguments": {"a": ', '}}\n</tool_call>',
    '{"name": "g", "parameters": {"b": [', "]}}; ", "]}}",
]  # fmt: skip
_KEY = st.text(string.ascii_letters + "_", min_size=1, max_size=5)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.text(string.printable + "éü<>", max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_KEY, children, max_size=3),
    max_leaves=8,
)
_CALL = st.tuples(st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=12),
                  st.dictionaries(_KEY, _JSON, max_size=4), st.sampled_from([None, 1, 2]))  # fmt: skip
_CONTENT = st.text(string.ascii_letters + string.digits + " .,!?\n", max_size=30)


def _hermes_text(content: str, calls: list[tuple[str, dict[str, Any], int | None]]) -> str:
    text = content
    for name, arguments, indent in calls:
        body = json.dumps({"name": name, "arguments": arguments}, indent=indent, ensure_ascii=False)
        text += f"\n<tool_call>\n{body}\n</tool_call>"
    return text


def _llama_text(tag: bool, calls: list[tuple[str, dict[str, Any], int | None]]) -> str:
    bodies = [json.dumps({"name": n, "parameters": a}, indent=i, ensure_ascii=False) for n, a, i in calls]
    return ("<|python_tag|>" if tag else "") + "; ".join(bodies)


def _cuts(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _compact(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parser=st.sampled_from([HermesParser, Llama3JsonParser]),
    text=st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_any_text_streamed_in_any_chunks_reassembles_to_the_whole_parse(parser, text, cuts):
    whole = _parse(parser, text)
    chunks, _ = _streamed(parser, _cuts(text, cuts))
    assert _reassembled(chunks) == {"content": whole["content"], "calls": _calls(whole)}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    content=_CONTENT, calls=st.lists(_CALL, max_size=3), cuts=st.lists(st.integers(0, 10_000), max_size=12)
)
def test_hermes_reads_every_call_written_and_the_text_before_them(content, calls, cuts):
    text = _hermes_text(content, calls)
    expected = {
        "content": (content.rstrip() if calls else content) or None,
        "calls": [(name, _compact(arguments)) for name, arguments, _ in calls],
    }
    whole = _parse(HermesParser, text)
    assert {"content": whole["content"], "calls": _calls(whole)} == expected
    assert _reassembled(_streamed(HermesParser, _cuts(text, cuts))[0]) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tag=st.booleans(),
    calls=st.lists(_CALL, min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_llama3_json_reads_every_call_written(tag, calls, cuts):
    text = _llama_text(tag, calls)
    expected = {"content": None, "calls": [(name, _compact(arguments)) for name, arguments, _ in calls]}
    whole = _parse(Llama3JsonParser, text)
    assert {"content": whole["content"], "calls": _calls(whole)} == expected
    assert _reassembled(_streamed(Llama3JsonParser, _cuts(text, cuts))[0]) == expected


# ----------------------------------------------------------------------------------- the flags
def test_serve_hands_the_chat_flags_to_the_openai_server(tmp_path):
    from paged_llm.cli.arguments import build_parser, chat_flags
    from paged_llm.cli.serve import main

    template = tmp_path / "tools.jinja"
    template.write_text("{{ messages }}")
    args = build_parser().parse_args(
        ["serve", "--chat-template", str(template), "--tool-call-parser", "llama3_json",
         "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1"]
    )  # fmt: skip
    assert chat_flags(args) == [
        "--chat-template", str(template.resolve()), "--tool-call-parser", "llama3_json",
        "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1",
    ]  # fmt: skip
    assert chat_flags(build_parser().parse_args(["serve"])) == []
    # as vLLM: auto tool choice without a parser is refused before anything starts
    assert main(["serve", "--enable-auto-tool-choice"]) == 2


def test_the_openai_servers_chat_settings_reach_every_worker(tmp_path):
    from paged_llm.openai.server import chat_template_text, main
    from paged_llm.openai.settings import OpenAISettings

    template = tmp_path / "tools.jinja"
    template.write_text("{{ messages }}")
    assert chat_template_text(str(template)) == chat_template_text("{{ messages }}") == "{{ messages }}"
    with pytest.raises(SystemExit, match="no such file"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    assert main(["--enable-auto-tool-choice"]) == 2
    settings = OpenAISettings(
        "127.0.0.1:1", chat_template="{{ x }}", tool_call_parser="hermes", enable_auto_tool_choice=True,
        reasoning_parser="qwen3",
    )  # fmt: skip
    assert OpenAISettings.from_json(settings.to_json()) == settings  # (what --workers > 1 hands over)
