"""TensorRT-LLM's own client expectations, stated as our tests (issue "Drop-in for vllm_backend and
TensorRT-LLM clients", item 3). They follow what inflight_batcher_llm/client/end_to_end_grpc_client.py
of triton-inference-server/tensorrtllm_backend at r24.10 (af89ec75993a91ad2ade0a1c92792f320a4a5751)
sends and reads; the code is ours.

That client: model `ensemble` or `tensorrt_llm_bls`; every input a [1, 1] tensor (`bad_words` and
`stop_words` [1, n]); a gRPC stream per request without empty final responses; for each response it
reads `text_output` and takes `[0].decode()` (1-D), and `batch_index` and takes `[0][0]`.
"""

from __future__ import annotations

import json
import queue
import re

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tests.e2e.client import http_post

ENSEMBLE_NAMES = ("ensemble", "tensorrt_llm_bls")
PROMPT = "Paged attention splits the cache into"


def _inputs(
    prompt: str, output_len: int, streaming: bool, **extra: np.ndarray
) -> list[grpcclient.InferInput]:
    arrays = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.array([[output_len]], dtype=np.int32),
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),  # the client's default
        **extra,
    }
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _run(url: str, model: str, prompt: str, output_len: int, streaming: bool, **extra: np.ndarray):
    """(text as the client assembles it, the results, the errors), as end_to_end_grpc_client.py does."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer(model, _inputs(prompt, output_len, streaming, **extra), request_id="")
    client.stop_stream()  # waits for the server to close the stream
    client.close()
    text, responses, errors = "", [], []
    while not results.empty():
        item = results.get()
        if isinstance(item, InferenceServerException):
            errors.append(item.message())
            continue
        output = item.as_numpy("text_output")
        if model in ENSEMBLE_NAMES:
            assert item.as_numpy("batch_index")[0][0] == 0
        else:  # llm_trtllm: the tensorrt_llm model's [1, 1] (the client's output[0].decode would fail)
            output = output.reshape(-1)
        responses.append(item)
        text = text + output[0].decode("utf-8") if streaming else output[0].decode("utf-8")
    return text, responses, errors


def words(*items: str) -> np.ndarray:
    return np.array([list(items)], dtype=object)


def scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


@pytest.mark.parametrize("model", ENSEMBLE_NAMES)
def test_default_names_answer_streaming_and_not_in_the_ensembles_layout(server, model):
    whole, [response], errors = _run(server.grpc_url, model, PROMPT, 12, streaming=False)
    assert not errors and response.as_numpy("text_output").shape == (1,)
    assert response.as_numpy("batch_index").shape == (1, 1)
    streamed, responses, errors = _run(server.grpc_url, model, PROMPT, 12, streaming=True)
    assert not errors and len(responses) > 1
    assert all(r.as_numpy("text_output").shape == (1,) for r in responses)
    # greedy (TensorRT-LLM samples only with top_k or top_p): the same tokens both ways; not
    # streaming, the text starts with the prompt (exclude_input_in_output unset)
    assert whole == PROMPT + streamed and streamed


@pytest.mark.parametrize("streaming", [False, True], ids=["no-stream", "stream"])
def test_stop_words_bad_words_end_id_pad_id_and_penalties(server, streaming):
    url, model = server.grpc_url, "ensemble"
    plain, _, errors = _run(url, model, PROMPT, 16, streaming)
    assert not errors
    generated = plain[len(PROMPT) :] if not streaming else plain
    stop = generated[len(generated) // 2 :][:3]
    assert stop.strip(), generated
    stopped, _, errors = _run(url, model, PROMPT, 16, streaming, stop_words=words(stop))
    assert not errors
    assert stopped == plain[: plain.index(stop, len(PROMPT) if not streaming else 0)]
    banned = generated.split()[1]
    without, _, errors = _run(url, model, PROMPT, 16, streaming, bad_words=words(banned))
    assert not errors
    assert banned not in (without[len(PROMPT) :] if not streaming else without)
    everything = {
        "end_id": scalar(2, np.int32),
        "pad_id": scalar(2, np.int32),
        "repetition_penalty": scalar(1.3, np.float32),
        "presence_penalty": scalar(0.4, np.float32),
        "frequency_penalty": scalar(0.2, np.float32),
        "stop_words": words(stop),
        "bad_words": words(banned),
    }
    text, responses, errors = _run(url, model, PROMPT, 16, streaming, **everything)
    assert not errors and responses and text


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("return_context_logits", scalar(True, bool), "return_context_logits: returning logits"),
        ("return_generation_logits", scalar(True, bool), "return_generation_logits: returning logits"),
        ("embedding_bias_words", words("x"), "embedding_bias_words: embedding bias is not supported"),
        ("beam_width", scalar(2, np.int32), "beam_width: only 1 is supported"),
    ],
)
def test_what_the_engine_cannot_do_is_an_error_naming_the_input(server, name, value, message):
    extra = {name: value}
    if name == "embedding_bias_words":
        extra["embedding_bias_weights"] = np.array([[1.0]], dtype=np.float32)
    _, responses, errors = _run(server.grpc_url, "tensorrt_llm_bls", PROMPT, 4, False, **extra)
    assert not responses and len(errors) == 1 and message in errors[0], errors


def test_llm_trtllm_keeps_the_tensorrt_llm_models_layout(server):
    _, [response], errors = _run(server.grpc_url, "llm_trtllm", PROMPT, 4, streaming=False)
    assert not errors and response.as_numpy("text_output").shape == (1, 1)
    assert response.as_numpy("output_ids").shape == (1, 1, 4) and response.as_numpy("batch_index") is None


@pytest.mark.parametrize("streaming", [False, True], ids=["no-stream", "stream"])
def test_a_batch_of_prompts_answers_each_row_under_its_batch_index(server, streaming):
    """end_to_end_grpc_client.py --batch-inputs: the prompts stacked into one [2, 1] request; the
    client files each response's text under its batch_index."""
    prompts = ["The first prompt", "A second, longer prompt of the batch"]
    singles = [_run(server.grpc_url, "ensemble", p, 8, streaming)[0] for p in prompts]
    arrays = {
        "text_input": np.array([[p] for p in prompts]).astype(object),
        "max_tokens": np.array([[8], [8]], dtype=np.int32),
        "stream": np.array([[streaming], [streaming]], dtype=bool),
        "beam_width": np.array([[1], [1]], dtype=np.int32),
        "temperature": np.array([[1.0], [1.0]], dtype=np.float32),
    }
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer("ensemble", tensors, request_id="")
    client.stop_stream()
    client.close()
    texts = ["", ""]
    while not results.empty():
        item = results.get()
        assert not isinstance(item, InferenceServerException), item
        index = item.as_numpy("batch_index")[0][0]
        piece = item.as_numpy("text_output")[0].decode("utf-8")
        texts[index] = texts[index] + piece if streaming else piece
    assert texts == singles


# Guided decoding as end_to_end_grpc_client.py --guided-decoding-guide-type / --guided-decoding-guide
# sends it (tensorrtllm_backend's docs/guided_decoding.md, at c2e65b88d85255be30cf50440a91662abeb497dd):
# two more [1, 1] BYTES inputs. The tiny model is random: bounded constraints it can finish.
GUIDED = [
    ("json_schema", '{"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, '
     '"maximum": 9999}}, "required": ["answer"], "additionalProperties": false}',
     lambda text: set(json.loads(text)) == {"answer"} and 0 <= json.loads(text)["answer"] <= 9999),
    ("regex", r"\d{4}", lambda text: re.fullmatch(r"[0-9]{4}", text)),
    ("ebnf_grammar", 'root ::= "20" [0-9] [0-9]', lambda text: re.fullmatch(r"20[0-9]{2}", text)),
]  # fmt: skip
YEAR_PROMPT = "What is the year after 2024? Answer:"


@pytest.mark.parametrize("streaming", [False, True], ids=["no-stream", "stream"])
@pytest.mark.parametrize(("guide_type", "guide", "holds"), GUIDED, ids=[g[0] for g in GUIDED])
def test_guided_decoding_holds_the_output_to_the_guide(server, streaming, guide_type, guide, holds):
    extra = {
        "guided_decoding_guide_type": words(guide_type),
        "guided_decoding_guide": words(guide),
        "exclude_input_in_output": scalar(True, bool),
    }
    text, responses, errors = _run(server.grpc_url, "ensemble", YEAR_PROMPT, 30, streaming, **extra)
    assert not errors and responses
    assert holds(text), text


def test_guide_type_json_over_http_generate_as_tensorrtllm_backends_curl_example(server):
    body = {"text_input": YEAR_PROMPT, "max_tokens": 6, "bad_words": "", "stop_words": "", "pad_id": 2,
            "end_id": 2, "guided_decoding_guide_type": "json"}  # fmt: skip
    status, text = http_post(server.http_url, "/v2/models/ensemble/generate", body)
    assert status == 200, text
    output = json.loads(text)["text_output"]
    assert output.startswith(YEAR_PROMPT + "{"), output  # the random model never closes the object


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"guided_decoding_guide": words(r"\d+")}, "guided_decoding_guide: a guide needs"),
        ({"guided_decoding_guide_type": words("regex")}, "guided_decoding_guide: guide type regex needs"),
        ({"guided_decoding_guide_type": words("lark"), "guided_decoding_guide": words("x")},
         "guided_decoding_guide_type: unknown guide type 'lark'"),
        # found by the engine core's compile, named as this client sent it
        ({"guided_decoding_guide_type": words("regex"), "guided_decoding_guide": words("[0-9")},
         "guided_decoding_guide: "),
        ({"guided_decoding_guide_type": words("json_schema"),
          "guided_decoding_guide": words('{"type": "array", "uniqueItems": true}')},
         "guided_decoding_guide/uniqueItems: unsupported JSON Schema keyword: unique array items"),
    ],
    ids=["guide-without-type", "type-without-guide", "unknown-type", "bad-regex", "unenforceable-schema"],
)  # fmt: skip
def test_a_guided_decoding_mistake_is_an_error_naming_the_input(server, extra, message):
    for model in ("tensorrt_llm_bls", "llm_trtllm"):
        _, responses, errors = _run(server.grpc_url, model, PROMPT, 4, False, **extra)
        assert not responses and len(errors) == 1 and errors[0].startswith(message), errors
    assert _run(server.grpc_url, "ensemble", PROMPT, 4, False)[1]  # still serving
