"""The reasoning parsers (qwen3, deepseek_r1): where the <think> block starts, read from the rendered
prompt's end; the split whole and streamed in any chunks (the same parts); tool calls read from the
answer only."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.openai.chat_output import ChoiceOutput, deltas, message
from paged_llm.openai.reasoning import ReasoningSplitter, prompt_think_state
from paged_llm.openai.tool_parsers import HermesParser


@pytest.mark.parametrize(
    ("prompt", "state"),
    [
        ("<|im_start|>assistant\n", "none"),
        ("<|im_start|>assistant\n<think>\n", "open"),
        ("<｜Assistant｜><think>", "open"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),  # Qwen3, enable_thinking false
    ],
)
def test_the_prompts_end_says_where_the_output_starts(prompt, state):
    assert prompt_think_state(prompt) == state


def _split(parser: str, state: str, text: str, tools: bool = False) -> dict[str, Any]:
    output = ChoiceOutput(ReasoningSplitter(parser, state), HermesParser() if tools else None)  # type: ignore[arg-type]
    return message(output.feed(text) + output.finish(), output.call_ids, True)


@pytest.mark.parametrize(
    ("parser", "state", "text", "reasoning", "content"),
    [
        # qwen3, the model opens the block itself
        ("qwen3", "none", "<think>\nplan</think>\n\nanswer", "\nplan", "\n\nanswer"),
        ("qwen3", "none", "answer, no thinking", None, "answer, no thinking"),
        ("qwen3", "none", "<think>cut by max_tokens", "cut by max_tokens", None),
        ("qwen3", "none", "<thin", None, "<thin"),
        ("qwen3", "none", "a</think>b", None, "a</think>b"),  # no block opened: all answer
        # qwen3, a template that opens it in the prompt (Qwen3-Thinking-2507, Qwen3.5)
        ("qwen3", "open", "plan</think>\n\nanswer", "plan", "\n\nanswer"),
        # the prompt closed the block (enable_thinking false): all answer
        ("qwen3", "closed", "<think>a</think>b", None, "<think>a</think>b"),
        # deepseek_r1: the prompt opens the block; a <think> the model writes again is dropped
        ("deepseek_r1", "open", "plan</think>answer", "plan", "answer"),
        ("deepseek_r1", "none", "<think>plan</think>answer", "plan", "answer"),
        ("deepseek_r1", "open", "no end, all reasoning", "no end, all reasoning", None),
        ("deepseek_r1", "open", "</think>", None, None),
        ("deepseek_r1", "closed", "answer", None, "answer"),
    ],
)
def test_split(parser, state, text, reasoning, content):
    result = _split(parser, state, text)
    assert (result["reasoning_content"], result["content"]) == (reasoning, content)
    assert result["reasoning"] == result["reasoning_content"]  # vLLM >= 0.11's name too


def test_tool_calls_are_read_from_the_answer_only():
    text = (
        '<think>maybe <tool_call>\n{"name": "no", "arguments": {}}\n</tool_call>?</think>\n\n'
        '<tool_call>\n{"name": "yes", "arguments": {"a": 1}}\n</tool_call>'
    )
    result = _split("qwen3", "none", text, tools=True)
    assert result["reasoning_content"].startswith("maybe <tool_call>") and result["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in result["tool_calls"]] == [
        ("yes", '{"a":1}')
    ]


def test_reasoning_streams_as_reasoning_content_deltas():
    output = ChoiceOutput(ReasoningSplitter("deepseek_r1", "open"), None)
    chunks = []
    for piece in ["pla", "n</th", "ink>ans", "wer"]:
        chunks += deltas(output.feed(piece), output.call_ids)
    chunks += deltas(output.finish(), output.call_ids)
    assert chunks == [
        {"reasoning_content": "pla", "reasoning": "pla"},
        {"reasoning_content": "n", "reasoning": "n"},  # "</th" held back until it is known
        {"content": "ans"},
        {"content": "wer"},
    ]


_FRAGMENTS = ["<think>", "</think>", "<th", "ink>", "</th", "<", "/", ">", "a", " ", "\n", "<tool_call>",
              '{"name": "f", "arguments": {}}', "</tool_call>"]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parser=st.sampled_from(["qwen3", "deepseek_r1"]),
    state=st.sampled_from(["none", "open", "closed"]),
    tools=st.booleans(),
    text=st.lists(st.sampled_from(_FRAGMENTS), max_size=30).map("".join),
    cuts=st.lists(st.integers(0, 10_000), max_size=10),
)
def test_streamed_in_any_chunks_the_split_is_the_whole_texts(parser, state, tools, text, cuts):
    whole = _split(parser, state, text, tools)
    output = ChoiceOutput(ReasoningSplitter(parser, state), HermesParser() if tools else None)
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = []
    for a, b in itertools.pairwise(points):
        chunks += deltas(output.feed(text[a:b]), output.call_ids)
    chunks += deltas(output.finish(), output.call_ids)
    reasoning = "".join(c.get("reasoning_content", "") for c in chunks) or None
    content = "".join(c.get("content", "") for c in chunks) or None
    names = [call["function"]["name"] for c in chunks for call in c.get("tool_calls", []) if "id" in call]
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert names == [call["function"]["name"] for call in whole.get("tool_calls", [])]
