"""The TensorRT-LLM convention's codec (triton_model/trtllm_codec.py) and the three models' configs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from paged_llm.errors import InvalidRequestError
from paged_llm.launcher.repository import TRTLLM_MODEL_NAMES
from paged_llm.paths import model_repository_template
from paged_llm.triton_model.trtllm_codec import (
    INPUT_NAMES,
    MAX_BATCH_SIZE,
    TrtllmResponseState,
    client_error_text,
    split_batch,
    to_llm_request,
)


def batch(value, dtype=None) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def words(*items: str) -> np.ndarray:
    return np.array([[w.encode() for w in items]], dtype=np.object_)


def sampling(inputs) -> dict:
    request = to_llm_request(inputs)
    return json.loads(request.inputs["sampling_parameters"][0])


def test_stop_and_bad_words_end_id_and_the_accepted_no_ops():
    params = sampling({
        "text_input": text("Hi"), "max_tokens": batch(5, np.int32), "stop_words": words("a", ""),
        "bad_words": words("foo", "bar baz"), "end_id": batch(7, np.int32), "pad_id": batch(0, np.int32),
        "length_penalty": batch(1.5, np.float32), "beam_width": batch(1, np.int32),
        "num_return_sequences": batch(1, np.int32), "return_context_logits": batch(False),
        "repetition_penalty": batch(1.2, np.float32), "presence_penalty": batch(0.5, np.float32),
    })  # fmt: skip
    assert params["stop"] == ["a"] and params["bad_words"] == ["foo", "bar baz"]
    assert params["stop_token_ids"] == [7] and params["max_tokens"] == 5
    assert params["repetition_penalty"] == pytest.approx(1.2) and params["presence_penalty"] == 0.5
    assert params["temperature"] == 0.0  # TensorRT-LLM: greedy unless top_k or top_p is set
    assert "pad_id" not in params and "length_penalty" not in params


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("return_context_logits", batch(True), "returning logits is not supported"),
        ("return_generation_logits", batch(True), "returning logits is not supported"),
        ("num_return_sequences", batch(2, np.int32), "only 1 is supported"),
        ("beam_width", batch(4, np.int32), "only 1 is supported"),
        ("embedding_bias_words", words("x"), "embedding bias is not supported"),
        ("decoder_text_input", text("x"), "encoder-decoder"),
        ("prompt_embedding_table", np.zeros((1, 2, 4), np.float16), "prompt tuning"),
        ("pad_id", batch(0.5, np.float32), "must be an integer"),
        ("bad_words", np.array([[1, 2]], dtype=np.int32), "must be BYTES strings"),
    ],
)
def test_inputs_the_engine_cannot_honour_are_refused_by_name(name, value, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        to_llm_request({"text_input": text("Hi"), name: value})
    assert caught.value.field == name


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("end_id", batch(-1, np.int32), "must be in"),
        ("min_length", batch(-5, np.int32), "must be in"),
        ("runtime_top_p", batch(1.5, np.float32), "must be in"),
        ("runtime_top_k", batch(-3, np.int32), "must be -1"),
        ("random_seed", batch("x", np.object_), "must be"),
        ("top_p", batch(1.5, np.float32), "must be in"),
    ],
)
def test_sampling_errors_name_the_input_the_client_sent(name, value, message):
    """Not the llm parameter it becomes (end_id -> stop_token_ids, runtime_top_p -> top_p)."""
    with pytest.raises(InvalidRequestError, match=message) as caught:
        to_llm_request({"text_input": text("Hi"), name: value})
    assert caught.value.field == name
    assert str(caught.value).startswith(f"{name}: ")


@pytest.mark.parametrize("stream", [True, False])
def test_the_two_response_layouts(stream):
    request = to_llm_request({"text_input": text("Hi"), "stream": batch(stream)})
    outputs = {
        "text_output": np.array([b" there"], dtype=np.object_),
        "output_ids": np.array([5, 6], dtype=np.int32),
        "num_input_tokens": np.array([1], dtype=np.uint32),
    }
    ensemble = TrtllmResponseState(request, "ensemble").convert(outputs)
    assert set(ensemble) == {"text_output", "batch_index"}
    assert ensemble["text_output"].shape == (1,) and ensemble["text_output"][0] == b" there"
    assert ensemble["batch_index"].tolist() == [[0]] and ensemble["batch_index"].dtype == np.int32
    tensorrt_llm = TrtllmResponseState(request, "tensorrt_llm").convert(outputs)
    assert tensorrt_llm["text_output"].shape == (1, 1) and tensorrt_llm["output_ids"].shape == (1, 1, 2)
    assert tensorrt_llm["sequence_length"].tolist() == [[3]]  # the prompt's token counts too
    with pytest.raises(ValueError, match="response_layout"):
        TrtllmResponseState(request, "beams")


def test_a_batch_becomes_one_llm_request_per_row():
    inputs = {
        "text_input": np.array([[b"first"], [b"second"]], dtype=np.object_),
        "max_tokens": np.array([[3], [5]], dtype=np.int32),
        "stop_words": np.array([[b"x", b""], [b"y", b"z"]], dtype=np.object_),
    }
    rows = [to_llm_request(row) for row in split_batch(inputs)]
    assert [r.inputs["text_input"].tolist() for r in rows] == [[b"first"], [b"second"]]
    params = [json.loads(r.inputs["sampling_parameters"][0]) for r in rows]
    assert [(p["max_tokens"], p["stop"]) for p in params] == [(3, ["x"]), (5, ["y", "z"])]
    assert len(split_batch({"text_input": text("one")})) == 1
    outputs = {"text_output": np.array([b"t"], dtype=np.object_), "output_ids": np.array([1], dtype=np.int32)}
    assert TrtllmResponseState(rows[1], "ensemble", batch_index=1).convert(outputs)[
        "batch_index"
    ].tolist() == [[1]]


SCHEMA = '{"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}'


@pytest.mark.parametrize(
    ("guide_type", "guide", "structured_outputs"),
    [
        ("json", None, {"json_object": True}),
        ("json", "", {"json_object": True}),  # an empty guide is no guide (the clients' "unset")
        ("json_schema", SCHEMA, {"json": SCHEMA}),
        ("regex", r"\d+", {"regex": r"\d+"}),
        ("ebnf_grammar", "root ::= [0-9]+", {"grammar": "root ::= [0-9]+"}),
    ],
)
def test_guided_decoding_inputs_become_the_llm_models_structured_outputs(
    guide_type, guide, structured_outputs
):
    """tensorrtllm_backend's guide types (its tensorrt_llm model's guide type mapping)."""
    inputs = {"text_input": text("Hi"), "guided_decoding_guide_type": text(guide_type)}
    if guide is not None:
        inputs["guided_decoding_guide"] = text(guide)
    request = to_llm_request(inputs)
    assert json.loads(request.inputs["sampling_parameters"][0])["structured_outputs"] == structured_outputs
    assert request.guide_kind == next(iter(structured_outputs))


def test_no_guided_decoding_without_a_guide_type():
    for inputs in ({}, {"guided_decoding_guide_type": text(""), "guided_decoding_guide": text("")}):
        request = to_llm_request({"text_input": text("Hi"), **inputs})
        assert "structured_outputs" not in json.loads(request.inputs["sampling_parameters"][0])
        assert request.guide_kind is None


@pytest.mark.parametrize(
    ("inputs", "field", "message"),
    [
        ({"guided_decoding_guide": text(r"\d+")}, "guided_decoding_guide",
         "needs guided_decoding_guide_type"),
        ({"guided_decoding_guide_type": text("regex")}, "guided_decoding_guide",
         "guide type regex needs a guide"),
        ({"guided_decoding_guide_type": text("json_schema"), "guided_decoding_guide": text("")},
         "guided_decoding_guide", "guide type json_schema needs a guide"),
        ({"guided_decoding_guide_type": text("structural_tag"), "guided_decoding_guide": text("{}")},
         "guided_decoding_guide_type", "unknown guide type 'structural_tag' (known: json, json_schema"),
        ({"guided_decoding_guide_type": text("json"), "guided_decoding_guide": text(SCHEMA)},
         "guided_decoding_guide", "use json_schema for a schema"),
        ({"guided_decoding_guide_type": text("json_schema"), "guided_decoding_guide": text("{oops")},
         "guided_decoding_guide", "invalid JSON"),
        ({"guided_decoding_guide_type": batch(1, np.int32)}, "guided_decoding_guide_type", "BYTES"),
        ({"guided_decoding_guide_type": text("regex"), "guided_decoding_guide": batch(b"\xff", np.object_)},
         "guided_decoding_guide", "not valid UTF-8"),
    ],
)  # fmt: skip
def test_a_guided_decoding_mistake_is_refused_naming_the_input(inputs, field, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as caught:
        to_llm_request({"text_input": text("Hi"), **inputs})
    assert caught.value.field == field and str(caught.value).startswith(f"{field}: ")


def test_the_llm_models_errors_about_the_guide_name_the_guide():
    """What only llm or its engine core finds (max_grammar_bytes, a regex that does not compile)
    comes back naming structured_outputs.<kind>: the client sent guided_decoding_guide."""
    request = to_llm_request(
        {
            "text_input": text("Hi"),
            "guided_decoding_guide_type": text("regex"),
            "guided_decoding_guide": text("[0-9"),
        }
    )
    assert (
        client_error_text(request, "structured_outputs.regex: Regex parsing error at position 4")
        == "guided_decoding_guide: Regex parsing error at position 4"
    )
    assert client_error_text(request, "max_tokens: must be >= 1") == "max_tokens: must be >= 1"
    plain = to_llm_request({"text_input": text("Hi")})
    assert client_error_text(plain, "structured_outputs.regex: x") == "structured_outputs.regex: x"


def _config(name: str) -> str:
    return (model_repository_template() / name / "config.pbtxt").read_text()


def _inputs(config: str) -> dict[str, str]:
    block = config[config.index("\ninput [") : config.index("\noutput [")]
    return dict(re.findall(r'name: "(\w+)", data_type: (\w+)', block))


def test_the_three_models_take_the_same_inputs_the_codec_reads_and_pick_their_layout():
    inputs = {name: _inputs(_config(name)) for name in TRTLLM_MODEL_NAMES}
    assert inputs["ensemble"] == inputs["tensorrt_llm_bls"] == inputs["llm_trtllm"]
    assert set(inputs["ensemble"]) == set(INPUT_NAMES)
    layouts = {
        name: re.search(r'key: "response_layout", value: \{ string_value: "(\w+)" \}', _config(name)).group(1)
        for name in TRTLLM_MODEL_NAMES
    }
    assert layouts == {"llm_trtllm": "tensorrt_llm", "ensemble": "ensemble", "tensorrt_llm_bls": "ensemble"}
    for name in ("ensemble", "tensorrt_llm_bls"):
        assert f"max_batch_size: {MAX_BATCH_SIZE}" in _config(name)
    for name in TRTLLM_MODEL_NAMES:  # one implementation, imported (not a copy)
        model_py = model_repository_template() / name / "1" / "model.py"
        assert "from paged_llm.triton_model.trtllm_model import TritonPythonModel" in model_py.read_text()


def test_the_ensemble_names_have_tensorrt_llms_input_types():
    # all_models/inflight_batcher_llm/ensemble/config.pbtxt of triton-inference-server/tensorrtllm_backend
    # at r24.10 (af89ec75993a91ad2ade0a1c92792f320a4a5751): the types its clients send
    expected = {
        "text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "bad_words": "TYPE_STRING",
        "stop_words": "TYPE_STRING", "end_id": "TYPE_INT32", "pad_id": "TYPE_INT32", "top_k": "TYPE_INT32",
        "top_p": "TYPE_FP32", "temperature": "TYPE_FP32", "length_penalty": "TYPE_FP32",
        "repetition_penalty": "TYPE_FP32", "min_length": "TYPE_INT32", "presence_penalty": "TYPE_FP32",
        "frequency_penalty": "TYPE_FP32", "random_seed": "TYPE_UINT64", "return_log_probs": "TYPE_BOOL",
        "return_context_logits": "TYPE_BOOL", "return_generation_logits": "TYPE_BOOL",
        "beam_width": "TYPE_INT32", "stream": "TYPE_BOOL", "prompt_embedding_table": "TYPE_FP16",
        "prompt_table_extra_id": "TYPE_UINT64", "prompt_vocab_size": "TYPE_INT32",
        "embedding_bias_words": "TYPE_STRING", "embedding_bias_weights": "TYPE_FP32",
        "decoder_text_input": "TYPE_STRING",
    }  # fmt: skip
    # guided decoding: the same file at c2e65b88d85255be30cf50440a91662abeb497dd (May 2025)
    expected |= {"guided_decoding_guide_type": "TYPE_STRING", "guided_decoding_guide": "TYPE_STRING"}
    declared = _inputs(_config("ensemble"))
    assert {name: declared.get(name) for name in expected} == expected
    outputs = dict(re.findall(r'name: "(\w+)", data_type: (\w+)', _config("ensemble").split("\noutput [")[1]))
    assert outputs["text_output"] == "TYPE_STRING" and outputs["batch_index"] == "TYPE_INT32"
