"""Output constraints in the OpenAI server: every request field -> the llm model's
`sampling_parameters.structured_outputs`, the 400s naming the client's field (the engine's
errors renamed too), and the structural tags the chat route builds (tool calls, a reasoning block
before the constraint), compiled by xgrammar as the engine core compiles them and run through a
matcher: a well-formed output is accepted, a malformed one refused, and the parser reads back what
the grammar lets through."""

from __future__ import annotations

import json
from typing import Any

import pytest

from paged_llm.openai.chat_constraint import chat_constraint
from paged_llm.openai.chat_output import ChoiceOutput, message
from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from paged_llm.openai.reasoning import ReasoningSplitter
from paged_llm.openai.tool_parsers import TOOL_CALL_PARSERS
from paged_llm.openai.triton_client import error_from_output
from paged_llm.structured_output_params import parse_structured_outputs

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# What the openai SDK's parse() sends for a pydantic model (strict json_schema: $defs, $ref, anyOf)
PYDANTIC_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "Weather",
        "strict": True,
        "schema": {
            "$defs": {
                "Place": {
                    "properties": {"city": {"title": "City", "type": "string", "maxLength": 12}},
                    "required": ["city"],
                    "title": "Place",
                    "type": "object",
                    "additionalProperties": False,
                }
            },
            "properties": {
                "place": {"$ref": "#/$defs/Place"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Note"},
            },
            "required": ["place", "note"],
            "title": "Weather",
            "type": "object",
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "hi"}]


def _body(route: type, **fields: Any) -> Any:
    base = (
        {"model": "m", "messages": MESSAGES}
        if route is ChatCompletionRequest
        else {"model": "m", "prompt": "x"}
    )
    return parse_body(json.dumps({**base, **fields}).encode(), route)


def _error(route: type, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        _body(route, **fields)
    assert info.value.status_code == 400
    return info.value


ROUTES = [CompletionRequest, ChatCompletionRequest]


SO = "structured_outputs"
TAG = {"type": "structural_tag", "format": {"type": "any_text"}}
GRAMMAR = 'root ::= "a"'


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("fields", "field", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format", {"json_object": True}),
        ({"response_format": PYDANTIC_FORMAT}, "response_format.json_schema.schema",
         {"json": PYDANTIC_FORMAT["json_schema"]["schema"]}),
        ({SO: {"json": SCHEMA}}, f"{SO}.json", {"json": SCHEMA}),
        ({SO: {"json_object": True}}, f"{SO}.json_object", {"json_object": True}),
        ({SO: {"regex": "[a-z]+", "disable_any_whitespace": True}}, f"{SO}.regex",
         {"regex": "[a-z]+", "disable_any_whitespace": True}),
        ({SO: {"choice": ["yes", "no"]}}, f"{SO}.choice", {"choice": ["yes", "no"]}),
        ({SO: {"grammar": GRAMMAR}}, f"{SO}.grammar", {"grammar": GRAMMAR}),
        ({SO: {"structural_tag": TAG}}, f"{SO}.structural_tag", {"structural_tag": TAG}),
        ({"guided_json": SCHEMA}, "guided_json", {"json": SCHEMA}),
        ({"guided_json": json.dumps(SCHEMA)}, "guided_json", {"json": json.dumps(SCHEMA)}),
        ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "guided_regex", {"regex": "a+"}),
        ({"guided_choice": ["a"], "guided_whitespace_pattern": ""}, "guided_choice", {"choice": ["a"]}),
        ({"guided_grammar": GRAMMAR}, "guided_grammar", {"grammar": GRAMMAR}),
    ],
)  # fmt: skip
def test_each_field_becomes_structured_outputs(route, fields, field, spec):
    constraint = _body(route, **fields).constraint
    assert (constraint.field, constraint.spec) == (field, spec)
    parse_structured_outputs(constraint.spec, 1 << 20)  # what the llm model's stub accepts


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"response_format": {"type": "text"}},
        {"structured_outputs": {"json_object": False}},
        {"guided_json": None},
    ],
)
def test_no_constraint(route, fields):
    assert _body(route, **fields).constraint is None


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "nope"}}}}, "response_format.json_schema.schema/type", "not a valid JSON Schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}},
         "response_format.json_schema.schema/properties/tags/uniqueItems", "unsupported JSON Schema keyword"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "Missing required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
         "response_format.json_schema.name", "Invalid value"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "Invalid value"),
        ({"guided_json": {"type": "object", "not": {}}}, "guided_json/not", "unsupported JSON Schema"),
        ({"guided_json": "{not json"}, "guided_json", "invalid JSON"),
        ({"guided_choice": []}, "guided_choice", "at least one choice"),
        ({SO: {"choice": []}}, f"{SO}.choice", "at least one choice"),
        ({SO: {"regex": ""}}, f"{SO}.regex", "non-empty"),
        ({SO: {"regex": "a", "choice": ["a"]}}, SO, "got 2: regex, choice"),
        ({SO: {"pattern": "a"}}, f"{SO}.pattern", "unknown key"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "response_format and guided_regex were both given"),
        ({SO: {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
         "structured_outputs and guided_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_field(route, fields, param, words):
    error = _error(route, **fields)
    assert error.param == param and words in error.message, (error.param, error.message)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"response_format": PYDANTIC_FORMAT}, "response_format.json_schema.schema"),
    ],
)
def test_an_engine_error_about_the_constraint_names_the_clients_field(fields, param):
    constraint = _body(CompletionRequest, **fields).constraint
    engine_field = f"structured_outputs.{constraint.kind}"
    error = constraint.client_error(
        error_from_output([f"invalid_arg\t{engine_field}: Regex parsing error at 3"])
    )
    assert (error.status_code, error.param, error.message) == (
        400,
        param,
        f"{param}: Regex parsing error at 3",
    )
    # the same constraint sent after a reasoning block (inside a structural tag)
    wrapped = chat_constraint(constraint, None, None, "deepseek_r1", "open")
    error = wrapped.client_error(error_from_output(["invalid_arg\tstructured_outputs.structural_tag: bad"]))
    assert (error.param, error.message) == (param, f"{param}: bad")
    unrelated = error_from_output(["invalid_arg\tmax_tokens: must be in [1, 9]"])
    assert constraint.client_error(unrelated).param == "max_tokens"


def test_the_chat_constraint_goes_after_the_reasoning_block_unless_the_prompt_closed_it():
    constraint = _body(ChatCompletionRequest, guided_regex="[a-z]+").constraint
    assert chat_constraint(constraint, None, None, None, "open") is constraint  # no reasoning parser
    assert chat_constraint(constraint, None, None, "qwen3", "closed") is constraint
    wrapped = chat_constraint(constraint, None, None, "qwen3", "none")
    assert wrapped.field == "guided_regex" and wrapped.kind == "structural_tag"
    tag = wrapped.spec["structural_tag"]
    assert tag["type"] == "structural_tag" and tag["format"]["elements"][0]["type"] == "optional"
    assert tag["format"]["elements"][1] == {"type": "regex", "pattern": "[a-z]+"}
    # a client's own structural tag says what the whole output is
    own = _body(ChatCompletionRequest, structured_outputs={"structural_tag": TAG})
    assert chat_constraint(own.constraint, None, None, "deepseek_r1", "open") is own.constraint


# ----------------------------------------------------------------------- compiled as the engine does
@pytest.fixture(scope="module")
def compile_spec(tiny_model_dir):
    """spec (structured_outputs) -> compiled grammar, through the stub's checks and the engine's compile."""
    xgrammar = pytest.importorskip("xgrammar")
    from paged_llm.structured_output.compile import compile_constraint
    from paged_llm.structured_output.tokenizer_info import build_tokenizer_info

    compiler = xgrammar.GrammarCompiler(build_tokenizer_info(tiny_model_dir, 151936, [151645]))

    def compile_(spec: dict[str, Any]) -> Any:
        params = parse_structured_outputs(spec, 1 << 20)
        return compile_constraint(compiler, params.kind, params.spec, params.any_whitespace is True)

    return compile_


def _accepts(grammar: Any, text: str) -> bool:
    """Whether the grammar takes `text` as a whole output (then the end of the sequence)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.accept_token(151645) and matcher.is_terminated()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _tool_constraint(parser: str, reasoning: str | None, state: str, **fields: Any) -> Any:
    body = _body(ChatCompletionRequest, tools=TOOLS, **fields)
    return chat_constraint(None, body.tool_use, TOOL_CALL_PARSERS[parser].call_format, reasoning, state)


def _call(parser: str, name: str, arguments: dict[str, Any]) -> str:
    call_format = TOOL_CALL_PARSERS[parser].call_format
    return call_format.begin(name) + json.dumps(arguments) + call_format.end


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_required_tool_calls_compile_and_hold_the_output_to_calls_the_parser_reads(compile_spec, parser):
    weather, time = _call(parser, "get_weather", {"city": "Oslo", "days": 3}), _call(parser, "get_time", {})
    separator = TOOL_CALL_PARSERS[parser].call_format.separator
    grammar = compile_spec(_tool_constraint(parser, None, "none", tool_choice="required").spec)
    for text in (weather, time, weather + separator + time):
        assert _accepts(grammar, text), text
        output = ChoiceOutput(None, TOOL_CALL_PARSERS[parser]())
        result = message(output.feed(text) + output.finish(), output.call_ids, False)
        assert result["content"] is None and [c["function"]["name"] for c in result["tool_calls"]] == [
            name for name in ("get_weather", "get_time") if name in text
        ]
    for bad in (
        "",  # no call
        "Sure. " + weather,  # text around the calls
        _call(parser, "get_weather", {"city": "Paris", "days": 3}),  # arguments outside the schema
        _call(parser, "get_weather", {"city": "Oslo"}),  # a required argument missing
        _call(parser, "get_date", {}),  # no such function
    ):
        assert not _accepts(grammar, bad), bad
    single = compile_spec(
        _tool_constraint(parser, None, "none", tool_choice="required", parallel_tool_calls=False).spec
    )
    assert _accepts(single, weather) and not _accepts(single, weather + separator + time)


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_a_named_function_is_exactly_one_call_of_it(compile_spec, parser):
    named = {"type": "function", "function": {"name": "get_weather"}}
    grammar = compile_spec(_tool_constraint(parser, None, "none", tool_choice=named).spec)
    weather = _call(parser, "get_weather", {"city": "Rome", "days": 9})
    assert _accepts(grammar, weather)
    separator = TOOL_CALL_PARSERS[parser].call_format.separator
    for bad in (_call(parser, "get_time", {}), weather + separator + weather, weather[:-1]):
        assert not _accepts(grammar, bad), bad


@pytest.mark.parametrize(
    ("reasoning", "state", "before"),
    [
        ("qwen3", "none", ["<think>plan</think>\n\n", ""]),  # optional: the model may not think
        ("qwen3", "open", ["plan</think>\n\n"]),
        ("deepseek_r1", "open", ["plan</think>", "<think>plan</think>"]),
        ("deepseek_r1", "none", ["<think>plan</think>"]),
    ],
)
@pytest.mark.parametrize(
    ("fields", "answer", "wrong"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
         '{"city": "Oslo", "days": 2}', '{"city": "Oslo"}'),
        ({"response_format": {"type": "json_object"}}, '{"any": [1]}', "[1]"),
        ({"guided_regex": "[a-z]{2,4}"}, "abc", "abcdef"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "no", "maybe"),
        ({"guided_grammar": 'root ::= "a" "b"*'}, "abb", "ba"),
    ],
)  # fmt: skip
def test_a_constraint_holds_the_answer_after_the_reasoning(
    compile_spec, reasoning, state, before, fields, answer, wrong
):
    constraint = chat_constraint(
        _body(ChatCompletionRequest, **fields).constraint, None, None, reasoning, state
    )
    grammar = compile_spec(constraint.spec)
    for prefix in before:
        assert _accepts(grammar, prefix + answer), prefix + answer
        assert not _accepts(grammar, prefix + wrong), prefix + wrong
        output = ChoiceOutput(ReasoningSplitter(reasoning, state), None)
        result = message(output.feed(prefix + answer) + output.finish(), [], True)
        assert result["content"].strip() == answer and result["reasoning_content"] in (None, "plan")
    assert not _accepts(grammar, "plan" + answer)  # the reasoning block must end before the answer


def test_required_calls_after_the_reasoning(compile_spec):
    grammar = compile_spec(_tool_constraint("hermes", "qwen3", "none", tool_choice="required").spec)
    call = _call("hermes", "get_time", {})
    assert _accepts(grammar, "<think>which tool?</think>\n\n" + call) and _accepts(grammar, call)
    assert not _accepts(grammar, "<think>which tool?</think>\n\nnone")
