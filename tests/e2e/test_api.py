"""The full request API through a real tritonserver: malformed requests, stop strings, n > 1,
logprobs, the TensorRT-LLM convention (llm_trtllm), and perf_analyzer streaming."""

from __future__ import annotations

import json
import queue
import re
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from paged_llm.launcher.launch import perf_analyzer_env, perf_analyzer_path
from paged_llm.paths import repo_root
from tests.e2e.client import http_post, make_inputs, stream, stream_many
from tests.e2e.metrics import value as metric_value
from tests.e2e.metrics import wait_for, wait_idle

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def _trt_inputs(prompt: str, **values) -> list[grpcclient.InferInput]:
    """TensorRT-LLM-style tensors: a batch dimension, shapes [1, 1]."""
    dtypes = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}
    arrays = {"text_input": (np.array([[prompt.encode()]], dtype=np.object_), "BYTES")}
    for name, value in values.items():
        if name == "stop_words":
            arrays[name] = (np.array([[w.encode() for w in value]], dtype=np.object_), "BYTES")
        elif name in ("seed", "random_seed"):
            arrays[name] = (np.array([[value]], dtype=np.uint64), "UINT64")
        else:
            triton_type, numpy_type = dtypes[type(value)]
            arrays[name] = (np.array([[value]], dtype=numpy_type), triton_type)
    inputs = []
    for name, (array, triton_type) in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


# (case id, model, prompt or input ids, extra inputs, text the error must contain)
MALFORMED = [
    ("bad-json", "llm", "Hi", {"sampling_parameters": "{oops"}, "sampling_parameters: invalid JSON"),
    ("json-array", "llm", "Hi", {"sampling_parameters": "[1]"}, "sampling_parameters: must be a JSON object"),
    ("unknown-key", "llm", "Hi", {"sampling_parameters": {"tempreature": 1}}, "tempreature: unknown"),
    ("negative-max-tokens", "llm", "Hi", {"sampling_parameters": {"max_tokens": -1}}, "max_tokens"),
    ("zero-max-tokens", "llm", "Hi", {"sampling_parameters": {"max_tokens": 0}}, "max_tokens"),
    ("huge-max-tokens", "llm", "Hi", {"sampling_parameters": {"max_tokens": 10**9}}, "max_tokens"),
    ("string-max-tokens", "llm", "Hi", {"sampling_parameters": {"max_tokens": "lots"}}, "max_tokens"),
    ("negative-temperature", "llm", "Hi", {"sampling_parameters": {"temperature": -1}}, "temperature"),
    ("temperature-type", "llm", "Hi", {"sampling_parameters": {"temperature": [1]}}, "temperature"),
    ("top-p-zero", "llm", "Hi", {"sampling_parameters": {"top_p": 0}}, "top_p"),
    ("top-p-above-one", "llm", "Hi", {"sampling_parameters": {"top_p": 1.5}}, "top_p"),
    ("top-k-negative", "llm", "Hi", {"sampling_parameters": {"top_k": -5}}, "top_k"),
    ("min-p", "llm", "Hi", {"sampling_parameters": {"min_p": 2}}, "min_p"),
    (
        "repetition-penalty",
        "llm",
        "Hi",
        {"sampling_parameters": {"repetition_penalty": 0}},
        "repetition_penalty",
    ),
    ("presence-penalty", "llm", "Hi", {"sampling_parameters": {"presence_penalty": 5}}, "presence_penalty"),
    (
        "frequency-penalty",
        "llm",
        "Hi",
        {"sampling_parameters": {"frequency_penalty": -3}},
        "frequency_penalty",
    ),
    ("n-zero", "llm", "Hi", {"sampling_parameters": {"n": 0}}, "n: must be"),
    ("n-huge", "llm", "Hi", {"sampling_parameters": {"n": 1000}}, "n: must be"),
    ("logprobs-huge", "llm", "Hi", {"sampling_parameters": {"logprobs": 100}}, "logprobs"),
    ("seed-type", "llm", "Hi", {"sampling_parameters": {"seed": "abc"}}, "seed"),
    ("stop-type", "llm", "Hi", {"sampling_parameters": {"stop": 123}}, "stop"),
    ("stop-token-negative", "llm", "Hi", {"sampling_parameters": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ("stop-token-oov", "llm", "Hi", {"sampling_parameters": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
    ("bool-type", "llm", "Hi", {"sampling_parameters": {"ignore_eos": "maybe"}}, "ignore_eos"),
    ("min-over-max", "llm", "Hi", {"sampling_parameters": {"min_tokens": 9, "max_tokens": 3}}, "min_tokens"),
    ("beam-search", "llm", "Hi", {"sampling_parameters": {"use_beam_search": True}}, "use_beam_search"),
    ("empty-prompt", "llm", "", {}, "text_input: the prompt is empty"),
    ("invalid-utf8", "llm", b"\xff\xfe bad", {}, "text_input: is not valid UTF-8"),
    ("oov-input-ids", "llm", [5, 999999], {}, "input_ids: token id 999999 is outside the vocabulary"),
    ("negative-input-ids", "llm", [-5], {}, "input_ids: token id -5 is outside the vocabulary"),
    (
        "too-long-prompt",
        "llm",
        [11] * 5000,
        {},
        "input_ids: the prompt has 5000 tokens but max_model_len is 4096",
    ),
    # a lone surrogate (JSON allows the escape, Unicode does not): it once crashed the server
    (
        "bad-word-lone-surrogate",
        "llm",
        "Hi",
        {"sampling_parameters": {"bad_words": ["\ud800"]}},
        "bad_words: not valid Unicode",
    ),
    (
        "key-lone-surrogate",
        "llm",
        "Hi",
        {"sampling_parameters": {"\udfff": 1}},
        "sampling_parameters: not valid Unicode",
    ),
    # past float32 (the sampler's): inf there, and -inf / inf is NaN
    (
        "temperature-past-float32",
        "llm",
        "Hi",
        {"sampling_parameters": {"temperature": 1e39}},
        "temperature: must be in",
    ),
    (
        "repetition-penalty-underflow",
        "llm",
        "Hi",
        {"sampling_parameters": {"repetition_penalty": 1e-46}},
        "repetition_penalty",
    ),
    (
        "temperature-400-digits",
        "llm",
        "Hi",
        {"sampling_parameters": {"temperature": 10**400}},
        "temperature: must be a finite number",
    ),
    ("trtllm-beam-width", "llm_trtllm", "Hi", {"beam_width": 2}, "beam_width: only 1 is supported"),
    # named as the client sent them, not as the llm parameters they become
    ("trtllm-end-id", "llm_trtllm", "Hi", {"end_id": -1}, "end_id: must be in"),
    ("trtllm-runtime-top-p", "llm_trtllm", "Hi", {"runtime_top_p": 1.5}, "runtime_top_p: must be in"),
    ("trtllm-min-length", "llm_trtllm", "Hi", {"min_length": -5}, "min_length: must be in"),
    ("trtllm-top-p", "llm_trtllm", "Hi", {"top_p": 7.0}, "top_p"),
    ("trtllm-max-tokens", "llm_trtllm", "Hi", {"max_tokens": -4}, "max_tokens"),
    # refused by llm, not llm_trtllm: the error crosses the BLS hop (as the paged_llm_error output)
    ("trtllm-too-long-prompt", "llm_trtllm", "hello " * 5000, {}, "but max_model_len is 4096"),
]


def _malformed_inputs(model: str, prompt, extra: dict) -> list[grpcclient.InferInput]:
    if model == "llm_trtllm":
        return _trt_inputs(prompt, **extra)
    if isinstance(prompt, bytes):
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([prompt], dtype=np.object_))
        return inputs + make_inputs([1], **extra)[1:]
    return make_inputs(prompt, **extra)


@pytest.mark.parametrize(
    ("case", "model", "prompt", "extra", "message"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_request_gets_invalid_arg_then_server_serves(server, case, model, prompt, extra, message):
    [bad] = stream_many(server.grpc_url, [_malformed_inputs(model, prompt, extra)], model=model)
    assert bad.finals == 1, f"{case}: expected exactly one final response"
    assert len(bad.errors) == 1 and not bad.responses, bad.errors
    assert message in bad.errors[0], bad.errors[0]
    good = stream(server.grpc_url, "and now a valid one", sampling_parameters={"max_tokens": 3})
    assert not good.errors and good.finals == 1 and good.text


def test_malformed_http_generate_is_400_with_the_field(server):
    assert len(MALFORMED) >= 25
    for body, field in [
        ({"text_input": "Hi", "temperature": -2}, "temperature"),
        ({"text_input": "Hi", "top_p": 2}, "top_p"),
        ({"text_input": "Hi", "bogus": 1}, "bogus"),
        ({"text_input": "", "max_tokens": 2}, "text_input"),
    ]:
        status, text = http_post(server.http_url, "/v2/models/llm/generate", body)
        assert status == 400, (body, status, text)
        assert field in json.loads(text)["error"]


def test_parameter_names_as_values_are_just_values(server):
    """The model looks for its own request parameters by key: a stop string that spells one is a stop
    string (it used to turn the request into an abort with an empty final)."""
    for name in ("paged_llm_abort_forwarded_request", "paged_llm_outputs"):
        body = {"text_input": "Hi", "max_tokens": 3, "stop": name}
        status, text = http_post(server.http_url, "/v2/models/llm/generate", body)
        assert status == 200 and json.loads(text)["text_output"], (name, status, text)


def test_llm_trtllm_rejects_unknown_keys_on_http_generate(server):
    for body, field in [
        ({"text_input": "Hi", "max_tokens": 3, "temprature": 0.5}, "temprature"),
        ({"text_input": "Hi", "max_tokens": 3, "top_kk": 4}, "top_kk"),
    ]:
        status, text = http_post(server.http_url, "/v2/models/llm_trtllm/generate", body)
        assert status == 400, (body, status, text)
        assert json.loads(text)["error"].startswith(f"{field}: unknown input or parameter")
    status, text = http_post(
        server.http_url, "/v2/models/llm_trtllm/generate", {"text_input": "Hi", "max_tokens": 3}
    )
    assert status == 200 and json.loads(text)["text_output"], text


@pytest.mark.parametrize(
    "sampling_parameters",
    ['{"a":' * 100_000 + "1" + "}" * 100_000, '{"max_tokens": ' + "9" * 5000 + "}"],
    ids=["nested-100000-deep", "integer-of-5000-digits"],
)
def test_hostile_json_is_one_line_invalid_arg_without_traceback(server, sampling_parameters):
    before = metric_value(server.metrics(), "paged_llm_final_responses_total", code="invalid_arg")
    body = {"text_input": "Hi", "sampling_parameters": sampling_parameters}
    status, text = http_post(server.http_url, "/v2/models/llm/generate", body)
    error = json.loads(text)["error"]
    assert status == 400 and error.startswith("sampling_parameters: invalid JSON"), (status, error[:300])
    assert "\n" not in error and "Traceback" not in error and ".py" not in error, error[:300]
    assert wait_for(
        lambda: (
            metric_value(server.metrics(), "paged_llm_final_responses_total", code="invalid_arg")
            == before + 1
        ),
        timeout_s=10,
    )
    good = stream(server.grpc_url, "and now a valid one", sampling_parameters={"max_tokens": 3})
    assert not good.errors and good.finals == 1 and good.text


def test_stop_strings_over_grpc_streaming_and_http_generate(server):
    prompt = "Stop strings are checked on text"
    full = stream(server.grpc_url, prompt, sampling_parameters=GREEDY, exclude_input_in_output=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip()
    params = dict(GREEDY, stop=[stop])
    streamed = stream(
        server.grpc_url, prompt, stream=True, sampling_parameters=params, return_finish_reason=True
    )
    assert streamed.text == full[: full.index(stop)]
    assert streamed.last("finish_reason").tolist() == [b"stop"]
    status, body = http_post(
        server.http_url,
        "/v2/models/llm/generate",
        {
            "text_input": prompt,
            "sampling_parameters": json.dumps(params),
            "exclude_input_in_output": True,
            "return_finish_reason": True,
        },
    )
    assert status == 200 and json.loads(body)["text_output"] == streamed.text
    assert json.loads(body)["finish_reason"] == "stop"


def test_n_samples_over_grpc_streaming_and_http_generate(server):
    params = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 12, "ignore_eos": True}
    streamed = stream(server.grpc_url, "Three samples please", stream=True, sampling_parameters=params)
    per_sample = ["", "", ""]
    for response in streamed.responses:
        texts = response.as_numpy("text_output")
        assert texts.shape == (3,)
        for index in range(3):
            per_sample[index] += texts[index].decode()
    status, body = http_post(
        server.http_url,
        "/v2/models/llm/generate",
        {
            "text_input": "Three samples please",
            "sampling_parameters": json.dumps(params),
            "exclude_input_in_output": True,
            "return_num_output_tokens": True,
        },
    )
    payload = json.loads(body)
    assert status == 200 and payload["text_output"] == per_sample
    assert payload["num_output_tokens"] == [12, 12, 12]
    assert len(set(per_sample)) > 1


def test_only_the_requested_outputs_are_sent(server):
    inputs = {
        "sampling_parameters": GREEDY,
        "exclude_input_in_output": True,
        "return_num_output_tokens": True,
    }
    [everything] = stream_many(server.grpc_url, [make_inputs("Requested outputs", **inputs)])
    [text_only] = stream_many(
        server.grpc_url, [make_inputs("Requested outputs", **inputs)], outputs=["text_output"]
    )
    [ids_and_counts] = stream_many(
        server.grpc_url,
        [make_inputs("Requested outputs", **inputs)],
        outputs=["output_ids", "num_output_tokens"],
    )
    assert text_only.text == everything.text and text_only.text
    assert all(r.as_numpy("output_ids") is not None for r in everything.responses)
    assert all(r.as_numpy("num_output_tokens") is not None for r in everything.responses)
    for response in text_only.responses:
        assert response.as_numpy("output_ids") is None and response.as_numpy("num_output_tokens") is None
    for response in ids_and_counts.responses:
        assert response.as_numpy("text_output") is None
    ids = [t for r in ids_and_counts.responses for t in r.as_numpy("output_ids").tolist()]
    assert len(ids) == GREEDY["max_tokens"]
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in ids_and_counts.responses) == len(ids)


def test_logprobs_and_cumulative_logprob(server):
    result = stream(
        server.grpc_url,
        "Log probabilities",
        sampling_parameters={"temperature": 0, "max_tokens": 5, "logprobs": 2},
        return_logprobs=True,
        return_cumulative_logprob=True,
        exclude_input_in_output=True,
    )
    [response] = result.responses
    positions = json.loads(response.as_numpy("logprobs")[0])
    ids = response.as_numpy("output_ids").tolist()
    assert len(positions) == 5
    total = 0.0
    for position, token_id in zip(positions, ids, strict=True):
        entries = {int(k): v for k, v in position.items()}
        assert token_id in entries and entries[token_id]["rank"] == 1  # greedy
        assert sorted(e["rank"] for e in entries.values()) == [1, 2]
        assert all(e["logprob"] <= 0 for e in entries.values())
        total += entries[token_id]["logprob"]
    assert response.as_numpy("cumulative_logprob")[0] == pytest.approx(total, abs=1e-4)
    status, body = http_post(
        server.http_url,
        "/v2/models/llm/generate",
        {
            "text_input": "Log probabilities",
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 5, "logprobs": 2}),
            "return_logprobs": True,
            "return_cumulative_logprob": True,
        },
    )
    payload = json.loads(body)
    assert status == 200 and json.loads(payload["logprobs"]) == positions
    assert payload["cumulative_logprob"] == pytest.approx(total, abs=1e-4)


def test_llm_and_llm_trtllm_give_the_same_greedy_text(server):
    prompt = "One engine, two conventions:"
    llm = stream(
        server.grpc_url,
        prompt,
        sampling_parameters={"temperature": 0, "max_tokens": 16},
        exclude_input_in_output=True,
    )
    [trt] = stream_many(
        server.grpc_url,
        [_trt_inputs(prompt, max_tokens=16, exclude_input_in_output=True)],
        model="llm_trtllm",
    )
    assert not trt.errors and trt.finals == 1
    assert trt.text == llm.text
    [trt_stream] = stream_many(
        server.grpc_url,
        [_trt_inputs(prompt, max_tokens=16, stream=True, return_log_probs=True)],
        model="llm_trtllm",
    )
    assert len(trt_stream.responses) >= 2 and trt_stream.text == llm.text
    last = trt_stream.responses[-1]
    assert last.as_numpy("output_ids").ndim == 3 and last.as_numpy("sequence_length")[0][0] > 16
    log_probs = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in trt_stream.responses])
    assert log_probs.shape == (16,) and (log_probs <= 0).all()


def test_cancelling_an_llm_trtllm_stream_ends_the_request_it_forwarded(server):
    """llm_trtllm forwards its client's cancellation to llm (Triton 2.51's BLS cannot cancel): the
    forwarded request ends CANCELLED long before its 3000 tokens, and the engine is idle again."""
    wait_idle(server)
    before = server.metrics()

    def finals(code: str) -> float:
        return metric_value(server.metrics(), "paged_llm_final_responses_total", code=code) - metric_value(
            before, "paged_llm_final_responses_total", code=code
        )

    events: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer(
        "llm_trtllm",
        _trt_inputs("cancel me through the BLS model", max_tokens=3000, min_length=3000, stream=True),
        request_id="trt-cancel",
        enable_empty_final_response=True,
    )
    _result, error = events.get(timeout=60)  # it runs
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_for(lambda: finals("cancelled") + finals("success") >= 1, timeout_s=120)
    assert (finals("cancelled"), finals("success")) == (1, 0)
    wait_idle(server)


def test_llm_trtllm_stop_words_and_seeded_sampling(server):
    [first] = stream_many(
        server.grpc_url,
        [_trt_inputs("Seeded", max_tokens=10, top_k=50, seed=5, exclude_input_in_output=True)],
        model="llm_trtllm",
    )
    [again] = stream_many(
        server.grpc_url,
        [_trt_inputs("Seeded", max_tokens=10, top_k=50, seed=5, exclude_input_in_output=True)],
        model="llm_trtllm",
    )
    assert first.text == again.text and first.text
    stop = first.text[3:5]
    [stopped] = stream_many(
        server.grpc_url,
        [
            _trt_inputs(
                "Seeded", max_tokens=10, top_k=50, seed=5, stop_words=[stop], exclude_input_in_output=True
            )
        ],
        model="llm_trtllm",
    )
    assert stopped.text == first.text[: first.text.index(stop)]


def test_perf_analyzer_streams_against_llm(server, tmp_path):
    input_file = repo_root() / "clients" / "perf_inputs" / "llm_streaming.json"
    completed = subprocess.run(
        [
            str(perf_analyzer_path()),
            "-m",
            "llm",
            "-u",
            server.grpc_url,
            "-i",
            "grpc",
            "--streaming",
            "--input-data",
            str(input_file),
            "--concurrency-range",
            "2",
            "--request-count",  # a fixed count, not a time window: a busy machine only takes longer
            "16",
            "-f",
            str(tmp_path / "perf.csv"),
        ],
        env=perf_analyzer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    match = re.search(r"Throughput: ([\d.]+) infer/sec", completed.stdout)
    assert match and float(match.group(1)) > 0, completed.stdout[-2000:]
    assert "error" not in completed.stdout.lower() or "Avg latency" in completed.stdout
