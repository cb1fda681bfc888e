"""The OpenAI server's pure parts: body validation, Triton response parsing, SSE events, metrics."""

from __future__ import annotations

import json
import struct

import pytest

from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.generation import Generation
from paged_llm.openai.metrics import OpenAIMetrics
from paged_llm.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from paged_llm.openai.responses import CompletionLogprobs, ResponseBuilder, chat_logprobs, sse
from paged_llm.openai.triton_client import error_from_output
from paged_llm.openai.triton_grpc import response_outputs
from paged_llm.openai.triton_request import GenerationChunk, SequenceDelta, parse_outputs


def _error(raw: bytes, model=CompletionRequest) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_body(raw, model)
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "m", "prompt": "x", "foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        ({"model": "m"}, "prompt", "Missing required parameter: 'prompt'"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt", "Invalid type for 'prompt'"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop", "stop strings must not be empty"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias", "not supported"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo", "not supported"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "stream",
        ),
    ],
)
def test_completion_bodies_are_refused_naming_the_field(body, param, message):
    error = _error(json.dumps(body).encode())
    assert error.status_code == 400 and error.param == param and message in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_chat_body_errors_name_nested_fields_and_sampling_maps_to_the_llm_model():
    error = _error(b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', ChatCompletionRequest)
    assert error.param == "messages[0].content"
    body = parse_body(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,'
        b' "logprobs": true, "top_logprobs": 2, "stop": "x", "seed": 3, "top_k": 5}',
        ChatCompletionRequest,
    )
    assert body.sampling_parameters() == {
        "max_tokens": 7, "n": 1, "seed": 3, "top_k": 5, "stop": ["x"], "logprobs": 2,
    }  # fmt: skip
    with pytest.raises(OpenAIError, match="image_url"):
        parse_body(
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            ChatCompletionRequest,
        ).messages[0].template_dict(0)
    completion = parse_body(b'{"model": "m", "prompt": [[1, 2], [3]]}', CompletionRequest)
    assert completion.prompts() == [[1, 2], [3]] and completion.sampling_parameters()["max_tokens"] == 16


class _Tensor:
    def __init__(self, name: str, datatype: str) -> None:
        self.name, self.datatype = name, datatype


class _Response:
    def __init__(self, tensors: list[tuple[str, str, bytes]]) -> None:
        self.outputs = [_Tensor(n, d) for n, d, _ in tensors]
        self.raw_output_contents = [raw for _, _, raw in tensors]


def _bytes(*items: str) -> bytes:
    return b"".join(struct.pack("<I", len(i.encode())) + i.encode() for i in items)


def test_raw_triton_outputs_become_per_sample_deltas():
    response = _Response([
        ("text_output", "BYTES", _bytes("hé", "")),
        ("num_output_tokens", "UINT32", struct.pack("<2I", 2, 1)),
        ("output_ids", "INT32", struct.pack("<3i", 7, 8, 9)),
        ("finish_reason", "BYTES", _bytes("length", "stop")),
        ("num_input_tokens", "UINT32", struct.pack("<I", 5)),
    ])  # fmt: skip
    chunk = parse_outputs(response_outputs(response), is_final=True)
    assert chunk.num_prompt_tokens == 5 and chunk.is_final
    first, second = chunk.sequences
    assert (first.text, first.num_tokens, first.token_ids, first.finish_reason) == ("hé", 2, [7, 8], "length")
    assert (second.text, second.num_tokens, second.token_ids, second.finish_reason) == ("", 1, [9], "stop")
    streamed = parse_outputs(response_outputs(response), is_final=False)
    assert streamed.sequences[0].finish_reason is None  # reasons count on the final response only
    # paged_llm_totals_on_final: num_output_tokens is each sample's total, not this response's
    outputs = {k: v for k, v in response_outputs(response).items() if k != "output_ids"}
    totals = parse_outputs(outputs, is_final=True, totals_on_final=True)
    assert [(d.num_tokens, d.total_tokens) for d in totals.sequences] == [(0, 2), (0, 1)]


def test_usage_counts_the_final_totals_once():
    generation = Generation(1, 1)
    for text_value, total in (("a", None), ("b", None), ("", 7)):
        delta = SequenceDelta(0, text_value, 0, [], None, "stop" if total else None, total)
        generation.absorb(0, GenerationChunk([delta], 3 if total else None, total is not None))
    assert generation.usage() == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}


def test_engine_errors_map_to_status_and_openai_param():
    error = error_from_output(["invalid_arg\tmax_tokens: 100000 exceeds max_model_len 4096"])
    assert (error.status_code, error.param) == (400, "max_tokens")
    assert error_from_output(["invalid_arg\ttext_input: the prompt is empty"]).param == "prompt"
    unavailable = error_from_output(["unavailable\tthe waiting queue is full"])
    assert unavailable.status_code == 503 and unavailable.headers == {"Retry-After": "1"}
    assert error_from_output(["internal\tthe model step failed"]).status_code == 500


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(("text", "reason"), [('a "quoted"\nline é', None), ("", "stop")])
def test_fast_text_events_equal_the_full_chunks(kind, text, reason):
    builder = ResponseBuilder(kind, "cmpl-1", 'model "x"')
    if kind == "chat":
        full = builder.chat_chunk(2, {"content": text}, None, reason)
    else:
        full = builder.completion_chunk(2, text, None, reason)
    event = builder.text_event(2, text, reason)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == json.loads(sse(full)[6:])


def test_logprobs_shapes():
    positions = [
        {"5": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
         "4": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
         "6": {"logprob": -3.0, "rank": 3, "decoded_token": "c"}},
        {"9": {"logprob": -0.2, "rank": 1, "decoded_token": "é"}},
    ]  # fmt: skip
    completion = CompletionLogprobs(k=1)
    part = completion.add(positions)
    assert part["tokens"] == ["b", "é"] and part["text_offset"] == [0, 1]
    assert part["top_logprobs"][0] == {"a": -0.1, "b": -0.5}  # the top 1 and the chosen one
    content = chat_logprobs(positions, k=2)
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["a", "b"]
    assert content[1]["bytes"] == list("é".encode())


def test_metrics_render_prometheus_text():
    metrics = OpenAIMetrics()
    metrics.started()
    metrics.first_token("completions", 0.03)
    metrics.tokens(5, 7)
    metrics.finished("completions", 200, 0.2)
    text = metrics.render()
    assert 'paged_llm_openai_requests_total{route="completions",status="200"} 1' in text
    assert "paged_llm_openai_requests_in_flight 0" in text
    assert 'paged_llm_openai_time_to_first_token_seconds_bucket{route="completions",le="0.05"} 1' in text
    assert "paged_llm_openai_generation_tokens_total 7" in text


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (b'{"model": "m", "prompt": "x", "n": true}', "n", "valid integer"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens", "valid integer"),
        (b'{"model": "m", "prompt": [4294967297]}', "prompt", "Invalid type"),
        (b'{"model": "m", "prompt": "x", "repetition_penalty": Infinity}', None, "not a JSON number"),
        (b'{"model": "m", "prompt": "\\ud800"}', None, "unpaired UTF-16 surrogate"),
        (b'{"model": "m", "prompt": "x", "stop": ["a\\uDFFF"]}', None, "unpaired UTF-16 surrogate"),
        (b'{"model": "m", "prompt": "a\xed\xa0\x80"}', None, "unpaired UTF-16 surrogate"),  # raw bytes
        ('{"model": "m", "prompt": "\\ud800"}'.encode("utf-16"), None, "unpaired UTF-16 surrogate"),
        (b"[" * 100000 + b"]" * 100000, None, "nested too deeply"),
        (json.dumps({"model": "m", "prompt": [[1]] * 2049}).encode(), "prompt", "at most 2048 prompts"),
        (json.dumps({"model": "m", "prompt": [[1]] * 100, "n": 21}).encode(), "n", "prompts x n is 2100"),
    ],
)
def test_bodies_that_used_to_reach_the_engine_or_a_500(raw, param, message):
    error = _error(raw)
    assert error.status_code == 400 and error.param == param and message in error.message


def test_escapes_that_are_not_lone_surrogates_pass():
    body = parse_body(b'{"model": "m", "prompt": "\\u00e9\\ud83d\\ude00 \\\\ud800"}', CompletionRequest)
    assert body.prompts() == ["\u00e9\U0001f600 \\ud800"]


def _raw_inputs(proto) -> dict[str, bytes]:
    return dict(zip((t.name for t in proto.inputs), proto.raw_input_contents, strict=True))


def test_requests_share_only_constant_flag_headers():
    """build_request reuses one BOOL tensor header per name; each request has its own values."""
    from paged_llm.openai.triton_grpc import build_request
    from paged_llm.openai.triton_request import GenerationRequest

    def flags(request: GenerationRequest) -> dict[str, bool]:
        raw = _raw_inputs(build_request(request))
        return {t.name: raw[t.name] == b"\x01" for t in build_request(request).inputs if t.datatype == "BOOL"}

    opening = GenerationRequest("m", [1, 2], {}, True, False, "a", {"session_id": "s", "session_start": True})
    closing = GenerationRequest("m", [3], {}, False, True, "b", {"session_id": "s", "session_end": True})
    assert flags(opening) == {
        "stream": True, "exclude_input_in_output": True, "return_finish_reason": True,
        "return_num_input_tokens": True, "return_num_output_tokens": True, "return_logprobs": False,
        "session_start": True, "session_end": False,
    }  # fmt: skip
    assert flags(closing)["stream"] is False and flags(closing)["return_logprobs"] is True
    assert flags(closing)["session_start"] is False and flags(closing)["session_end"] is True
    assert flags(opening)["stream"] is True  # unchanged by the request built after it


@pytest.mark.parametrize(
    "prompt, session",
    [("héllo", None), ([5, 6, 70000], None), ([1], {"session_id": "s1", "session_start": True})],
)
def test_request_protobuf_equals_what_tritonclient_builds(prompt, session):
    """The same message as tritonclient's stream_infer builds from InferInput objects (the wire
    format the server reads), inputs compared by name."""
    import numpy as np
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.grpc._utils import _get_inference_request

    from paged_llm.openai.triton_grpc import build_request
    from paged_llm.openai.triton_request import GenerationRequest

    request = GenerationRequest("llm", prompt, {"max_tokens": 3, "stop": ["é"]}, True, True, "req-1", session)
    outputs = ("text_output", "finish_reason")
    parameters = {"paged_llm_error_output": True, "paged_llm_totals_on_final": False}
    ours = build_request(request, outputs, parameters)

    def tensor(name, array, datatype):
        infer_input = grpcclient.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array)
        return infer_input

    if isinstance(prompt, str):
        inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")]
    else:
        inputs = [tensor("input_ids", np.asarray(prompt, dtype=np.int32), "INT32")]
    sampling = json.dumps(request.sampling_parameters).encode()
    inputs.append(tensor("sampling_parameters", np.array([sampling], dtype=np.object_), "BYTES"))
    flags = dict.fromkeys(
        ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens", "return_logprobs"),
        True,
    )  # fmt: skip
    if session is not None:
        inputs.append(tensor("session_id", np.array([b"s1"], dtype=np.object_), "BYTES"))
        flags.update(session_start=True, session_end=False)
    inputs += [tensor(name, np.array([value]), "BOOL") for name, value in flags.items()]
    theirs = _get_inference_request(
        model_name="llm", inputs=inputs, model_version="", request_id="req-1",
        outputs=[grpcclient.InferRequestedOutput(name) for name in outputs], sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=parameters,
    )  # fmt: skip
    assert _raw_inputs(ours) == _raw_inputs(theirs)

    def headers(proto) -> list[bytes]:
        return sorted(t.SerializeToString() for t in proto.inputs)

    assert headers(ours) == headers(theirs)
    for field in ("model_name", "model_version", "id", "outputs", "parameters"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_chat_template_kwargs_may_not_replace_the_template():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
    error = _error(raw + b'{"chat_template": "{% for a in range(9) %}{% endfor %}"}}', ChatCompletionRequest)
    assert error.param == "chat_template_kwargs" and "chat_template" in error.message
    ok = parse_body(raw + b'{"enable_thinking": false}}', ChatCompletionRequest)
    assert ok.chat_template_kwargs == {"enable_thinking": False}


def test_api_keys_refuse_empty_and_separator_characters():
    from paged_llm.openai.server import api_keys

    assert api_keys(["a1"], {"PAGED_LLM_API_KEY": "b2, c3"}) == ("a1", "b2", "c3")
    for bad in ([""], ["a,b"], ["a b"]):
        with pytest.raises(SystemExit, match="non-empty"):
            api_keys(bad, {})


def test_a_closing_streaming_response_closes_its_generator_and_reports_a_client_that_left():
    """Three ways a stream ends: sent to the end (200), a write that fails, and the client's
    disconnect seen by the request's DisconnectWatch while the stream waits for its next chunk
    (499 both). The generator is closed every time, and the watch's cancellation stays inside the
    response: the task that served it runs on normally afterwards."""
    import asyncio

    from starlette.requests import Request

    from paged_llm.openai.edge import ClosingStreamingResponse, DisconnectWatch, LastChunk

    closed: list[str] = []
    statuses: list[int] = []

    async def body():
        try:
            for i in range(100):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.001)
            yield LastChunk(b"data: [DONE]\n\n")
        finally:
            closed.append("closed")

    async def run(fail_write_after: int | None = None, disconnect_after: int | None = None) -> list[dict]:
        sent: list[dict] = []
        gone = asyncio.Event()

        async def send(message):
            sent.append(message)
            if fail_write_after is not None and len(sent) > fail_write_after:
                raise OSError("the client went away")
            if disconnect_after is not None and len(sent) > disconnect_after:
                gone.set()
            if message.get("more_body") is False:
                gone.set()  # as uvicorn: once the response is complete, receive() says disconnect
            await asyncio.sleep(0)  # a write may wait (flow control): other tasks run meanwhile

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        watch = DisconnectWatch(Request(scope, receive, send))
        response = ClosingStreamingResponse(body(), watch, media_type="text/event-stream")
        response.on_close = statuses.append
        await response(scope, receive, send)
        await asyncio.sleep(0.01)  # no cancellation left over for the task that served the request
        return sent

    sent = asyncio.run(run())
    assert sent[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    assert len(sent) == 102
    asyncio.run(run(fail_write_after=3))
    sent = asyncio.run(run(disconnect_after=5))
    assert len(sent) < 20  # the stream stopped soon after the disconnect
    assert closed == ["closed"] * 3 and statuses == [200, 499, 499]


def test_a_disconnect_whose_cancellation_was_swallowed_still_ends_the_request():
    """asyncio.wait_for before Python 3.12 can drop a cancellation that arrives as its inner
    awaitable completes: the client's disconnect must still end the request."""
    import asyncio

    from starlette.requests import Request

    from paged_llm.openai.edge import ClientDisconnected, DisconnectWatch, until_disconnect

    async def swallowing() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "finished anyway"
        return "slept"

    async def main() -> None:
        async def receive():
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        watch = DisconnectWatch(
            Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive, send)
        )
        with pytest.raises(ClientDisconnected):
            await until_disconnect(watch, swallowing())
        await asyncio.sleep(0.01)  # the task runs on: no cancellation left over
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    asyncio.run(main())


@pytest.mark.parametrize("system", [False, True])
def test_a_session_turn_renders_what_follows_the_previous_answer(tiny_model_dir, system):
    """The text of a later turn of a chat session, appended to what the server holds (the first
    turn's prompt, the answer and its end-of-turn token), is the whole conversation's prompt."""
    import asyncio

    from paged_llm.openai.chat_template import ChatTemplates

    templates = ChatTemplates({"llm": tiny_model_dir}, None, backend=None)

    def render(messages, after_an_answer=False):
        return asyncio.run(
            templates.render("llm", messages, True, False, None, after_an_answer=after_an_answer)
        )

    first = [{"role": "system", "content": "Be brief."}] * system + [{"role": "user", "content": "Hi"}]
    answer = {"role": "assistant", "content": "Hello there"}
    later = [{"role": "user", "content": "And then?"}]
    turn = render(later, after_an_answer=True)
    assert turn.startswith("\n<|im_start|>user")
    assert render(first) + answer["content"] + "<|im_end|>" + turn == render([*first, answer, *later])


def test_a_developer_message_is_a_system_message_to_a_template_that_does_not_know_the_role(tiny_model_dir):
    import asyncio

    from paged_llm.openai.chat_template import ChatTemplates

    templates = ChatTemplates({"llm": tiny_model_dir}, None, backend=None)

    def render(role: str) -> str:
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        return asyncio.run(templates.render("llm", messages, True, False, None))

    assert render("developer") == render("system")
    assert "<|im_start|>system\nBe brief.<|im_end|>" in render("developer")


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_tritonserver_that_is_not_there_is_a_503_naming_its_address(transport, monkeypatch):
    import asyncio
    import socket

    from paged_llm.openai import triton_grpc

    monkeypatch.setattr(triton_grpc, "RECONNECT_WAIT_S", 0.2)  # (how long a request waits for a channel)

    from paged_llm.openai.triton_client import BackendError, TritonClient
    from paged_llm.openai.triton_request import GenerationRequest

    with socket.socket() as sock:  # a port nothing listens on (bound, then closed)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def generate() -> BackendError:
        address = f"127.0.0.1:{port}"
        backend = TritonClient(address, http_url=address if transport == "http" else None)
        try:
            with pytest.raises(BackendError) as info:
                async for _chunk in backend.generate(GenerationRequest("llm", [1], {}, True, False, "r")):
                    pass
            return info.value
        finally:
            await backend.close()

    error = asyncio.run(generate())
    assert error.status_code == 503 and f"cannot reach tritonserver at 127.0.0.1:{port}" in error.message


def test_a_generate_request_carries_the_grpc_requests_inputs_by_name():
    """Over HTTP generate the same inputs as the gRPC protobuf (API.md), the transport flags as
    request parameters, and the outputs to build in paged_llm_outputs."""
    from paged_llm.openai.triton_grpc import build_request
    from paged_llm.openai.triton_http import generate_body
    from paged_llm.openai.triton_request import GenerationRequest

    session = {"session_id": "s1", "session_start": True}
    for prompt in ("héllo", [5, 6, 70000]):
        request = GenerationRequest("llm", prompt, {"max_tokens": 3, "stop": ["é"]}, True, True, "r", session)
        outputs = ("text_output", "finish_reason")
        parameters = {"paged_llm_error_output": True, "paged_llm_totals_on_final": True}
        body = json.loads(generate_body(request, outputs, parameters))
        proto = build_request(request, outputs, parameters)
        raw = _raw_inputs(proto)
        assert set(body) == {t.name for t in proto.inputs} | set(parameters) | {"paged_llm_outputs"}
        assert body["paged_llm_outputs"] == "text_output,finish_reason"
        assert json.loads(body["sampling_parameters"]) == request.sampling_parameters
        for tensor in proto.inputs:
            if tensor.datatype == "BOOL":
                assert body[tensor.name] is (raw[tensor.name] == b"\x01"), tensor.name
        if isinstance(prompt, str):
            assert body["text_input"] == prompt
        else:
            assert body["input_ids"] == prompt and struct.unpack("<3i", raw["input_ids"]) == tuple(prompt)
        assert body["session_id"] == "s1"
    # The key as the request parameter the llm model checks (Triton 2.51 forwards no header of a
    # generate request).
    with_key = json.loads(generate_body(request, None, {}, "Bearer k"))
    assert with_key["authorization"] == "Bearer k" and "paged_llm_outputs" not in with_key


def test_sse_events_cut_anywhere_come_out_whole():
    from paged_llm.openai.triton_http import EventSplitter

    events = [{"text_output": "a\n\nb", "model_name": "llm"}, {"text_output": ["x", "y"]}, {"error": "boom"}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    for cut in range(1, len(body)):
        splitter = EventSplitter()
        payloads = splitter.feed(body[:cut]) + splitter.feed(body[cut:])
        assert [json.loads(p) for p in payloads] == events, cut
    splitter = EventSplitter()
    assert [json.loads(p) for b in body for p in splitter.feed(bytes([b]))] == events  # byte by byte


def test_generate_events_become_output_lists_and_the_final_one_is_known():
    from paged_llm.openai.triton_http import event_outputs, is_final_response

    outputs = event_outputs(
        {"model_name": "llm", "model_version": "1", "text_output": "a", "num_output_tokens": [3, 4]}
    )
    assert outputs == {"text_output": ["a"], "num_output_tokens": [3, 4]}  # one element: a bare value
    streamed = {"text_output": ["a", "b"]}
    assert not is_final_response(streamed, stream=True)
    assert not is_final_response({**streamed, "finish_reason": ["length", "None"]}, stream=True)
    assert is_final_response({**streamed, "finish_reason": ["length", "stop"]}, stream=True)
    assert is_final_response({**streamed, "finish_reason": ["abort"]}, stream=True)
    assert is_final_response(streamed, stream=False)  # a request that is not streamed has one response


def test_the_openai_server_names_the_llm_models_inputs_outputs_and_parameters_as_the_model_does():
    """The OpenAI server does not import the engine: its spellings of our llm model's transport
    parameters, inputs and outputs must be the model's own (triton_model/triton_codec.py, config.pbtxt)."""
    import re
    from pathlib import Path

    from paged_llm.openai import triton_request
    from paged_llm.triton_model import triton_codec as model

    assert triton_request.ERROR_OUTPUT_PARAMETER == model.ERROR_OUTPUT_PARAMETER
    assert triton_request.TOTALS_ON_FINAL_PARAMETER == model.TOTALS_ON_FINAL_PARAMETER
    assert triton_request.OUTPUTS_PARAMETER == model.OUTPUTS_PARAMETER
    assert triton_request.CONTEXT_MUST_FIT_PARAMETER == model.CONTEXT_MUST_FIT_PARAMETER
    assert triton_request.ADD_SPECIAL_TOKENS_PARAMETER == model.ADD_SPECIAL_TOKENS_PARAMETER
    assert triton_request.ERROR_OUTPUT == model.FORWARDED_ERROR_OUTPUT
    from paged_llm.openai.triton_client import HEALTH_PROBE_PARAMETER
    from paged_llm.triton_model.health_probe import HEALTH_PROBE_PARAMETER as MODEL_HEALTH_PROBE_PARAMETER

    assert HEALTH_PROBE_PARAMETER == MODEL_HEALTH_PROBE_PARAMETER
    from paged_llm.openai.triton_client import _STATUS_OF_LABEL
    from paged_llm.triton_model.metric_families import FINAL_CODES

    assert set(_STATUS_OF_LABEL) == set(FINAL_CODES) - {"success"}  # every error label has a status
    config = (Path(__file__).parents[2] / "model_repository" / "llm" / "config.pbtxt").read_text()
    start = config.index("\noutput [")
    output_section = config[start : config.index("\n]", start)]
    output_names = set(re.findall(r'name:\s*"([^"]+)"', output_section))
    assert set(triton_request.PAGED_LLM_OUTPUTS) | {"logprobs"} <= output_names
    for prompt, session in (("text", None), ([1, 2], {"session_id": "s", "session_end": True})):
        request = triton_request.GenerationRequest("llm", prompt, {}, True, True, "r", session)
        assert set(triton_request.request_inputs(request)) <= set(model.INPUT_NAMES)


def test_generation_config_sampling_defaults_are_read_as_vllm_reads_them(tmp_path):
    from paged_llm.openai.chat_template import generation_defaults_of

    assert generation_defaults_of(None) == {} and generation_defaults_of(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "min_p": "x",
                    "repetition_penalty": True, "eos_token_id": [1, 2]})
    )  # fmt: skip
    assert generation_defaults_of(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults_of(tmp_path) == {}


def test_generation_defaults_are_asked_again_while_triton_does_not_answer(tiny_model_dir, tmp_path):
    """A worker that asked while Triton was not answering must not keep "no defaults" for good."""
    import asyncio
    import shutil

    from paged_llm.openai.chat_template import ChatTemplates

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_model_dir, checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))

    class Backend:
        def __init__(self) -> None:
            self.answers = [RuntimeError("not reachable"), {"model": str(checkpoint)}]

        async def model_parameters(self, model):
            answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            if isinstance(answer, Exception):
                raise answer
            return answer

    templates = ChatTemplates({}, None, backend=Backend())
    assert asyncio.run(templates.generation_defaults("llm")) == {}
    assert asyncio.run(templates.generation_defaults("llm")) == {"temperature": 0.6}


def test_the_openai_server_package_does_not_shadow_the_openai_sdk():
    import openai

    import paged_llm.openai

    assert openai is not paged_llm.openai and hasattr(openai, "OpenAI")  # (absolute imports)


def test_create_app_mounts_every_route_once():
    from paged_llm.openai.app import create_app
    from paged_llm.openai.settings import OpenAISettings

    app = create_app(OpenAISettings("127.0.0.1:1"))  # (no lifespan: nothing connects)
    served = [(route.path, sorted(route.methods)) for route in app.routes if route.path[:5] != "/docs"]
    assert served == [
        ("/openapi.json", ["GET", "HEAD"]),
        ("/redoc", ["GET", "HEAD"]),
        ("/health", ["GET"]),
        ("/version", ["GET"]),
        ("/metrics", ["GET"]),
        ("/v1/models", ["GET"]),
        ("/v1/models/{model:path}", ["GET"]),
        ("/v1/completions", ["POST"]),
        ("/v1/chat/completions", ["POST"]),
    ]
