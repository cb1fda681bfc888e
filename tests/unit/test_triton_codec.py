"""The codec between Triton tensors (as numpy) and engine inputs/outputs; no server needed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged_llm.engine.outputs import PositionLogprobs, RequestOutput, SequenceDelta, TopLogprob
from paged_llm.errors import InvalidRequestError
from paged_llm.sampling_params import RequestLimits
from paged_llm.serving.triton_codec import ResponseAccumulator, parse_request

LIMITS = RequestLimits()


def text(value: str | bytes) -> np.ndarray:
    raw = value.encode() if isinstance(value, str) else value
    return np.array([raw], dtype=np.object_)


def test_text_prompt_with_sampling_parameters_and_flags():
    parsed = parse_request(
        {
            "text_input": text("hi"),
            "stream": np.array([True]),
            "sampling_parameters": text('{"max_tokens": 3}'),
            "return_finish_reason": np.array([True]),
            "return_logprobs": np.array([False]),
        },
        None,
        LIMITS,
    )
    assert parsed.prompt_text == "hi" and parsed.stream and parsed.params.max_tokens == 3
    assert parsed.return_flags == {"return_finish_reason"}


def test_request_parameters_are_the_fallback():
    parsed = parse_request(
        {"text_input": text("hi")}, json.dumps({"max_tokens": 5, "temperature": 0}), LIMITS
    )
    assert parsed.params.max_tokens == 5 and parsed.params.temperature == 0


def test_asking_for_cumulative_logprob_turns_on_logprob_computation():
    parsed = parse_request(
        {"text_input": text("hi"), "return_cumulative_logprob": np.array([True])}, None, LIMITS
    )
    assert parsed.params.logprobs == 0


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({}, "text_input"),
        ({"text_input": text("a"), "input_ids": np.array([1], dtype=np.int32)}, "text_input"),
        ({"text_input": text("")}, "text_input"),
        ({"text_input": text(b"\xff\xfe")}, "text_input"),
        ({"input_ids": np.array([], dtype=np.int32)}, "input_ids"),
        ({"input_ids": np.array([1.5], dtype=np.float32)}, "input_ids"),
        ({"text_input": text("a"), "sampling_parameters": text("[]")}, "sampling_parameters"),
    ],
)
def test_malformed_inputs_name_the_field(inputs, field):
    with pytest.raises(InvalidRequestError) as info:
        parse_request(inputs, None, LIMITS)
    assert info.value.field == field


def _delta(index: int, text_value: str, ids: list[int], finish: str | None = None) -> SequenceDelta:
    logprobs = [PositionLogprobs(i, -0.5, 1, f"t{i}", [TopLogprob(i, -0.5, 1, f"t{i}")]) for i in ids]
    return SequenceDelta(index, text_value, ids, logprobs, -0.5 * len(ids), len(ids), finish)


def test_streaming_merges_pending_deltas_into_one_response():
    parsed = parse_request(
        {"text_input": text("p"), "stream": np.array([True]), "return_num_output_tokens": np.array([True])},
        None,
        LIMITS,
    )
    acc = ResponseAccumulator(parsed, "p", 1)
    acc.add(RequestOutput("r", 1, [_delta(0, "a", [1])], False))
    acc.add(RequestOutput("r", 1, [_delta(0, "b", [2])], False))
    first = acc.take()
    assert first is not None and first["text_output"].tolist() == [b"ab"]
    assert first["output_ids"].tolist() == [1, 2] and first["num_output_tokens"].tolist() == [2]
    assert acc.take() is None, "nothing new: no response"
    acc.add(RequestOutput("r", 1, [_delta(0, "c", [3], "length")], True))
    last = acc.take()
    assert last is not None and acc.finished and last["text_output"].tolist() == [b"c"]


def test_non_streaming_waits_for_the_end_and_echoes_the_prompt():
    parsed = parse_request(
        {
            "text_input": text("Hello"),
            "sampling_parameters": text('{"n": 2, "logprobs": 1}'),
            "return_finish_reason": np.array([True]),
            "return_logprobs": np.array([True]),
            "return_num_input_tokens": np.array([True]),
        },
        None,
        LIMITS,
    )
    acc = ResponseAccumulator(parsed, "Hello", 1)
    acc.add(RequestOutput("r", 1, [_delta(0, " a", [1]), _delta(1, " b", [2])], False))
    assert acc.take() is None
    acc.add(RequestOutput("r", 1, [_delta(0, "", [], "stop"), _delta(1, " c", [3], "length")], True))
    out = acc.take()
    assert out is not None
    assert out["text_output"].tolist() == [b"Hello a", b"Hello b c"]
    assert out["finish_reason"].tolist() == [b"stop", b"length"]
    assert out["num_input_tokens"].tolist() == [1]
    positions = json.loads(out["logprobs"][1].decode())
    assert [list(p) for p in positions] == [["2"], ["3"]]
    assert positions[0]["2"] == {"logprob": -0.5, "rank": 1, "decoded_token": "t2"}
