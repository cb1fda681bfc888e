"""ResponseAccumulator: RequestOutputs -> response tensors, merged up to max_merged_steps."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from paged_llm.engine.outputs import PositionLogprobs, RequestOutput, SequenceDelta, TopLogprob
from paged_llm.errors import RequestAbortedError
from paged_llm.sampling_params import RequestLimits
from paged_llm.triton_model.response_accumulator import ResponseAccumulator
from paged_llm.triton_model.triton_codec import parse_request

LIMITS = RequestLimits()


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def streaming(**flags: bool):
    inputs = {"text_input": text("p"), "stream": np.array([True])}
    inputs |= {name: np.array([value]) for name, value in flags.items()}
    return parse_request(inputs, None, LIMITS)


def _delta(index: int, text_value: str, ids: list[int], finish: str | None = None) -> SequenceDelta:
    logprobs = [PositionLogprobs(i, -0.5, 1, f"t{i}", [TopLogprob(i, -0.5, 1, f"t{i}")]) for i in ids]
    return SequenceDelta(index, text_value, ids, logprobs, -0.5 * len(ids), len(ids), finish)


def test_streaming_merges_pending_outputs_into_one_response():
    acc = ResponseAccumulator(streaming(return_num_output_tokens=True), "p", 1)
    acc.add(RequestOutput("r", 1, [_delta(0, "a", [1])], False))
    acc.add(RequestOutput("r", 1, [_delta(0, "b", [2])], False))
    first = acc.take()
    assert first is not None and not first.is_final and first.num_tokens == 2
    assert first.tensors["text_output"].tolist() == [b"ab"]
    assert first.tensors["output_ids"].tolist() == [1, 2] and first.tensors["num_output_tokens"].tolist() == [
        2
    ]
    assert acc.take() is None, "nothing new: no response"
    acc.add(RequestOutput("r", 1, [_delta(0, "c", [3], "length")], True))
    last = acc.take()
    assert last is not None and last.is_final and acc.finished
    assert last.tensors["text_output"].tolist() == [b"c"]


def test_a_response_merges_at_most_max_merged_steps():
    acc = ResponseAccumulator(streaming(), "p", 1, max_merged_steps=3)
    for token in range(1, 6):
        acc.add(RequestOutput("r", 1, [_delta(0, str(token), [token])], False))
    acc.add(RequestOutput("r", 1, [_delta(0, "x", [9], "length")], True, num_steps=2))
    sizes = []
    while acc.has_pending:
        response = acc.take()
        sizes.append((response.tensors["output_ids"].tolist(), response.is_final))
    assert sizes == [([1, 2, 3], False), ([4, 5], False), ([9], True)]


def test_one_step_per_response_when_max_merged_steps_is_one():
    acc = ResponseAccumulator(streaming(), "p", 1, max_merged_steps=1)
    for token in range(1, 4):
        acc.add(RequestOutput("r", 1, [_delta(0, str(token), [token])], token == 3))
    responses = [acc.take() for _ in range(3)]
    assert [r.tensors["output_ids"].tolist() for r in responses] == [[1], [2], [3]]
    assert [r.is_final for r in responses] == [False, False, True] and not acc.has_pending


def test_an_error_output_ends_it_and_cancelled_data_is_dropped():
    acc = ResponseAccumulator(streaming(), "p", 1)
    acc.add(RequestOutput("r", 1, [_delta(0, "a", [1])], False))
    assert acc.take(discard_data=True) is None, "the client cancelled: no more data"
    error = RequestAbortedError("cancelled by the client")
    acc.add(RequestOutput("r", 1, [_delta(0, "b", [2], "abort")], True, error))
    response = acc.take(discard_data=True)
    assert response.is_final and response.error is error and response.tensors is None


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
    acc = ResponseAccumulator(parsed, "Hello", 1, max_merged_steps=1)
    acc.add(RequestOutput("r", 1, [_delta(0, " a", [1]), _delta(1, " b", [2])], False))
    assert acc.take() is None
    acc.add(RequestOutput("r", 1, [_delta(0, "", [], "stop"), _delta(1, " c", [3], "length")], True))
    response = acc.take()
    assert response is not None and response.is_final
    out = response.tensors
    assert out["text_output"].tolist() == [b"Hello a", b"Hello b c"]
    assert out["finish_reason"].tolist() == [b"stop", b"length"]
    assert out["num_input_tokens"].tolist() == [1]
    positions = json.loads(out["logprobs"][1].decode())
    assert [list(p) for p in positions] == [["2"], ["3"]]
    assert positions[0]["2"] == {"logprob": -0.5, "rank": 1, "decoded_token": "t2"}


def test_only_requested_outputs_are_built():
    parsed = replace(streaming(return_num_output_tokens=True), requested_outputs=frozenset({"text_output"}))
    acc = ResponseAccumulator(parsed, "p", 1)
    acc.add(RequestOutput("r", 1, [_delta(0, "a", [1])], False))
    response = acc.take()
    assert response is not None and set(response.tensors) == {"text_output"} and response.num_tokens == 1
    parsed = replace(parsed, requested_outputs=frozenset({"output_ids", "num_output_tokens"}))
    acc = ResponseAccumulator(parsed, "p", 1)
    acc.add(RequestOutput("r", 1, [_delta(0, "a", [1, 2])], True))
    response = acc.take()
    assert response is not None and response.is_final
    assert set(response.tensors) == {"output_ids", "num_output_tokens"}
    assert response.tensors["output_ids"].tolist() == [1, 2]
    everything = ResponseAccumulator(streaming(return_num_output_tokens=True), "p", 1)
    everything.add(RequestOutput("r", 1, [_delta(0, "a", [1])], False))
    response = everything.take()
    assert response is not None and set(response.tensors) == {
        "text_output",
        "output_ids",
        "num_output_tokens",
    }


def test_totals_on_final_sends_text_alone_until_the_final_response():
    flags = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}
    inputs = {"text_input": text("p"), "stream": np.array([True])}
    inputs |= {name: np.array([value]) for name, value in flags.items()}
    parsed = parse_request(inputs, '{"paged_llm_totals_on_final": true}', LIMITS)
    assert parsed.totals_on_final and parsed.params.max_tokens != 0  # not a sampling parameter
    wanted = frozenset({"text_output", "finish_reason", "num_input_tokens", "num_output_tokens"})
    acc = ResponseAccumulator(
        replace(parsed, requested_outputs=wanted, params=replace(parsed.params, n=2)), "p", 4
    )
    acc.add(RequestOutput("r", 4, [_delta(0, "a", [1, 2]), _delta(1, "x", [5])], False))
    first = acc.take()
    assert set(first.tensors) == {"text_output"} and first.tensors["text_output"].tolist() == [b"a", b"x"]
    acc.add(RequestOutput("r", 4, [_delta(0, "b", [3], "length"), _delta(1, "", [6, 7], "stop")], True))
    last = acc.take()
    assert last.is_final and last.tensors["text_output"].tolist() == [b"b", b""]
    assert last.tensors["num_output_tokens"].tolist() == [3, 3], "the request's totals, per sample"
    assert last.tensors["finish_reason"].tolist() == [b"length", b"stop"]
    assert last.tensors["num_input_tokens"].tolist() == [4]


def test_totals_on_final_is_ignored_unless_streaming_and_only_a_json_true_counts():
    inputs = {"text_input": text("p")}
    assert not parse_request(inputs, '{"paged_llm_totals_on_final": true}', LIMITS).totals_on_final
    inputs["stream"] = np.array([True])
    assert not parse_request(inputs, '{"paged_llm_totals_on_final": "true"}', LIMITS).totals_on_final
    assert not parse_request(inputs, None, LIMITS).totals_on_final
