"""The codec between Triton tensors (as numpy) and engine inputs/outputs; no server needed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged_llm.errors import InvalidRequestError
from paged_llm.sampling_params import RequestLimits
from paged_llm.triton_model.triton_codec import parse_request, request_parameter_mapping, wants_error_output

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


def test_forwarded_errors_round_trip_through_their_output():
    from paged_llm.triton_model.triton_codec import (
        decode_forwarded_error,
        encode_forwarded_error,
        is_forwarded,
    )

    array = encode_forwarded_error("cancelled", "the server is shutting down\twith a tab")
    assert array.dtype == object and array.shape == (1,)
    assert decode_forwarded_error(array) == ("cancelled", "the server is shutting down\twith a tab")
    assert is_forwarded("paged_llm_trtllm/0f1e") and not is_forwarded("client-id")


def test_error_output_is_asked_for_by_a_parameter_or_a_forwarded_id_and_is_no_sampling_parameter():
    assert wants_error_output("", '{"paged_llm_error_output": true}')
    assert wants_error_output("paged_llm_trtllm/abc", "")
    assert not wants_error_output("", '{"paged_llm_error_output": false}')
    assert not wants_error_output("", '{"paged_llm_error_output": "true"}')  # only a JSON true
    assert not wants_error_output("", "")
    assert not wants_error_output("", "{not json paged_llm_error_output")
    # Without sampling_parameters the request parameters are the sampling parameters: the flag is
    # not one of them.
    assert request_parameter_mapping('{"paged_llm_error_output": true, "max_tokens": 3}') == {"max_tokens": 3}


def test_a_forwarded_authorization_header_is_found_and_is_no_sampling_parameter():
    from paged_llm.triton_model.triton_codec import authorization_of

    assert authorization_of('{"Authorization": "Bearer one", "max_tokens": 2}') == "Bearer one"
    assert authorization_of("") is None
    # a forwarded header is neither a sampling parameter nor an unknown one
    assert request_parameter_mapping('{"Authorization": "Bearer one", "max_tokens": 2}') == {"max_tokens": 2}


def test_session_fields_come_from_inputs_or_request_parameters():
    from paged_llm.core.sessions import SessionTurn

    as_inputs = parse_request(
        {"text_input": text("hi"), "session_id": text("chat-1"), "session_start": np.array([True])},
        None,
        LIMITS,
    )
    assert as_inputs.session == SessionTurn("chat-1", start=True, end=False)
    as_parameters = parse_request(
        {"text_input": text("hi")},
        json.dumps({"max_tokens": 3, "session_id": "chat-1", "session_end": "true"}),
        LIMITS,
    )
    assert as_parameters.session == SessionTurn("chat-1", start=False, end=True)
    assert as_parameters.params.max_tokens == 3  # session keys are not sampling parameters
    assert parse_request(
        {"text_input": text("hi")}, json.dumps({"session_id": 42}), LIMITS
    ).session == SessionTurn("42")
    assert parse_request({"text_input": text("hi")}, None, LIMITS).session is None


def test_a_close_needs_no_prompt_and_session_errors_name_their_field():
    close = parse_request({"session_id": text("c"), "session_end": np.array([True])}, None, LIMITS)
    assert close.closes_session_only
    close_empty_text = parse_request(
        {"text_input": text(""), "session_id": text("c"), "session_end": np.array([True])}, None, LIMITS
    )
    assert close_empty_text.closes_session_only
    with pytest.raises(InvalidRequestError, match="text_input: give exactly one"):
        parse_request({"session_id": text("c")}, None, LIMITS)  # a turn needs its new tokens
    with pytest.raises(InvalidRequestError, match="session_id: session_start and session_end need"):
        parse_request({"text_input": text("hi"), "session_start": np.array([True])}, None, LIMITS)
    with pytest.raises(InvalidRequestError, match="session_id: must be a non-empty string"):
        parse_request({"text_input": text("hi"), "session_id": text("")}, None, LIMITS)
    with pytest.raises(InvalidRequestError, match="session_end: must be a boolean"):
        parse_request({"text_input": text("hi")}, json.dumps({"session_id": "c", "session_end": 3}), LIMITS)


def test_paged_llm_outputs_narrows_the_outputs_a_generate_request_gets():
    """Triton's HTTP generate asks for every output; the parameter names the ones to build."""
    from paged_llm.triton_model.triton_codec import requested_outputs

    every = ["text_output", "output_ids", "finish_reason", "num_output_tokens"]
    assert requested_outputs(every, "") == frozenset(every)
    assert requested_outputs([], "") is None  # none named: all
    narrowed = requested_outputs(every, '{"paged_llm_outputs": "text_output, finish_reason"}')
    assert narrowed == {"text_output", "finish_reason"}
    # Names the request did not ask for stay out; with none asked, the parameter decides.
    assert requested_outputs(["text_output"], '{"paged_llm_outputs": "text_output,output_ids"}') == {
        "text_output"
    }
    assert requested_outputs([], '{"paged_llm_outputs": "output_ids"}') == {"output_ids"}
    with pytest.raises(InvalidRequestError) as info:
        requested_outputs(every, '{"paged_llm_outputs": 3}')
    assert info.value.field == "paged_llm_outputs"
    # A transport parameter, never a sampling parameter.
    assert request_parameter_mapping('{"paged_llm_outputs": "text_output", "top_k": 2}') == {"top_k": 2}


def test_the_models_parameters_are_found_by_key_not_by_their_text():
    """A value that spells a parameter's name is a value (a stop string once turned a request into
    an abort, and another into a paged_llm_outputs error)."""
    from paged_llm.triton_model.triton_codec import has_request_parameter, requested_outputs

    as_value = json.dumps({"stop": "paged_llm_outputs", "note": "paged_llm_abort_forwarded_request"})
    assert not has_request_parameter(as_value, "paged_llm_outputs")
    assert not has_request_parameter(as_value, "paged_llm_abort_forwarded_request")
    assert requested_outputs(["text_output"], as_value) == {"text_output"}
    assert has_request_parameter(
        '{"paged_llm_abort_forwarded_request": "x"}', "paged_llm_abort_forwarded_request"
    )
    assert not has_request_parameter("", "paged_llm_outputs") and not has_request_parameter(None, "x")


def test_lone_surrogates_are_refused_by_field_and_error_text_can_always_be_sent():
    from paged_llm.errors import wire_text
    from paged_llm.triton_model.triton_codec import decode_forwarded_error, encode_forwarded_error

    for sampling_parameters, field in [
        ('{"bad_words": ["\\ud800"]}', "bad_words"),
        ('{"stop": ["ok", "x\\udc00"]}', "stop"),
        ('{"\\udfff": 1}', "sampling_parameters"),
    ]:
        with pytest.raises(InvalidRequestError, match="not valid Unicode") as info:
            parse_request(
                {"text_input": text("hi"), "sampling_parameters": text(sampling_parameters)}, None, LIMITS
            )
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as info:
        parse_request({"text_input": text("hi")}, '{"stop": "\\ud83d"}', LIMITS)
    assert info.value.field == "stop"
    # A pair is one character (an emoji here), not an error.
    parsed = parse_request(
        {"text_input": text("hi"), "sampling_parameters": text('{"stop": "\\ud83d\\ude00"}')}, None, LIMITS
    )
    assert parsed.params.stop == ("\U0001f600",)
    assert wire_text("key \ud800 here") == "key \\ud800 here"
    assert decode_forwarded_error(encode_forwarded_error("invalid_arg", "x\ud800")) == (
        "invalid_arg",
        "x\\ud800",
    )


def test_context_fit_and_special_tokens_are_request_parameters_not_sampling_parameters():
    plain = parse_request({"text_input": text("hi")}, None, LIMITS)
    assert plain.add_special_tokens and not plain.context_must_fit  # vllm_backend's behaviour
    asked = parse_request(
        {"text_input": text("hi")},
        '{"add_special_tokens": false, "paged_llm_context_must_fit": true}',
        LIMITS,
    )
    assert not asked.add_special_tokens and asked.context_must_fit
    with pytest.raises(InvalidRequestError) as info:
        parse_request({"text_input": text("hi")}, '{"add_special_tokens": "maybe"}', LIMITS)
    assert info.value.field == "add_special_tokens"
