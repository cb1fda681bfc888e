from __future__ import annotations

import pytest

from paged_llm.errors import InvalidRequestError
from paged_llm.sampling_params import RequestLimits, SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams.from_json("")
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.n == 1
    assert params.top_p == 1.0 and params.top_k == 0 and params.skip_special_tokens


def test_string_values_are_coerced_like_genai_perf_sends_them():
    params = SamplingParams.from_json(
        '{"max_tokens": "32", "temperature": "0.7", "ignore_eos": "true", "top_k": "5", "seed": "-1", '
        '"stop": "END", "stop_token_ids": ["7", 9], "logprobs": "2"}'
    )
    assert params.max_tokens == 32 and params.temperature == 0.7 and params.ignore_eos is True
    assert params.top_k == 5 and params.seed == (1 << 64) - 1
    assert params.stop == ("END",) and params.stop_token_ids == (7, 9) and params.logprobs == 2


def test_null_max_tokens_means_until_max_model_len():
    assert SamplingParams.from_json('{"max_tokens": null}').max_tokens is None


def test_a_server_cap_bounds_null_and_default_max_tokens():
    capped = RequestLimits(max_tokens=100)
    # null stays "until max_model_len" here; the engine core bounds it once it knows the prompt
    assert SamplingParams.from_json('{"max_tokens": null}', capped).max_tokens is None
    assert SamplingParams.from_json("{}", capped).max_tokens == 16
    assert SamplingParams.from_json("{}", RequestLimits(max_tokens=8)).max_tokens == 8
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams.from_json('{"max_tokens": 101}', capped)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ('{"temperature": 1e39}', "temperature"),  # inf in float32: -inf / inf is NaN
        ('{"temperature": 1' + "0" * 400 + "}", "temperature"),  # float() of it overflows
        ('{"top_p": "1' + "0" * 400 + '"}', "top_p"),
        ('{"repetition_penalty": 1e-46}', "repetition_penalty"),  # 0 in float32
        ('{"repetition_penalty": 1e-38}', "repetition_penalty"),  # a logit of 4 divided by it is inf
        ('{"repetition_penalty": 1e39}', "repetition_penalty"),
    ],
)
def test_floats_must_fit_the_samplers_float32(payload, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_json(payload)
    assert info.value.field == field
    assert SamplingParams.from_json('{"temperature": 3e38, "repetition_penalty": 1e-6}').temperature == 3e38


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ("{bad", "sampling_parameters"),
        ("[1, 2]", "sampling_parameters"),
        ('{"max_tokens": 0}', "max_tokens"),
        ('{"max_tokens": -3}', "max_tokens"),
        ('{"max_tokens": 2.5}', "max_tokens"),
        ('{"max_tokens": true}', "max_tokens"),
        ('{"temperature": -0.1}', "temperature"),
        ('{"temperature": "hot"}', "temperature"),
        ('{"temperature": NaN}', "temperature"),
        ('{"top_p": 0}', "top_p"),
        ('{"top_p": 1.5}', "top_p"),
        ('{"top_k": -2}', "top_k"),
        ('{"min_p": 2}', "min_p"),
        ('{"repetition_penalty": 0}', "repetition_penalty"),
        ('{"presence_penalty": 3}', "presence_penalty"),
        ('{"frequency_penalty": -2.5}', "frequency_penalty"),
        ('{"n": 0}', "n"),
        ('{"n": 1000}', "n"),
        ('{"logprobs": 100}', "logprobs"),
        ('{"min_tokens": 20, "max_tokens": 10}', "min_tokens"),
        ('{"stop": 5}', "stop"),
        ('{"stop": [""]}', "stop"),
        ('{"stop_token_ids": [-1]}', "stop_token_ids"),
        ('{"seed": 1e30}', "seed"),
        ('{"ignore_eos": "maybe"}', "ignore_eos"),
        ('{"unknown_key": 1}', "unknown_key"),
        ('{"use_beam_search": true}', "use_beam_search"),
        ('{"best_of": 3}', "best_of"),
    ],
)
def test_bad_values_name_the_field(payload, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_json(payload)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")


def test_limits_come_from_config():
    limits = RequestLimits(max_n=2, max_logprobs=3, max_tokens=50)
    with pytest.raises(InvalidRequestError, match=r"n: must be in \[1, 2\]"):
        SamplingParams.from_mapping({"n": 3}, limits)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams.from_mapping({"logprobs": 4}, limits)
    with pytest.raises(InvalidRequestError, match=r"max_tokens: must be in \[1, 50\]"):
        SamplingParams.from_mapping({"max_tokens": 51}, limits)


def test_vocabulary_bound_on_stop_token_ids():
    params = SamplingParams.from_json('{"stop_token_ids": [5, 200000]}')
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        params.validate_for_vocab(151936)


def test_vllm_compat_keys_accepted_with_no_op_values():
    params = SamplingParams.from_json('{"n": 2, "best_of": 2, "use_beam_search": false}')
    assert params.n == 2
