"""vllm_backend's own client expectations, stated as our tests (issue "Drop-in for vllm_backend and
TensorRT-LLM clients", item 1). Each test names the upstream file it follows, from
triton-inference-server/vllm_backend; the code is ours."""

from __future__ import annotations

import json
import queue
import re

import jsonschema
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.client import http_post, make_inputs, sse_events, stream
from tests.e2e.metrics import value, wait_for

# ci/L0_additional_outputs_vllm/additional_outputs_test.py at r24.12
# (0b9c8e255388ea3dbb5d9b395dbd1a247d1fe4d2)
GREEDY = {"temperature": "0", "top_p": "1", "max_tokens": 12, "ignore_eos": True}
PROMPT = "In this example,"


@pytest.mark.parametrize("stream_mode", [True, False], ids=["stream", "no-stream"])
def test_finish_reason_is_the_string_none_on_every_response_but_the_last(server, stream_mode):
    result = stream(server.grpc_url, PROMPT, stream=stream_mode, sampling_parameters=GREEDY,
                    return_finish_reason=True)  # fmt: skip
    assert not result.errors and result.responses
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in result.responses]
    assert reasons[:-1] == ["None"] * (len(reasons) - 1) and reasons[-1] == "length"
    assert len(result.responses) > 1 if stream_mode else len(result.responses) == 1
    unasked = stream(server.grpc_url, PROMPT, stream=stream_mode, sampling_parameters=GREEDY)
    assert all(r.as_numpy("finish_reason") is None for r in unasked.responses)


@pytest.mark.parametrize("stream_mode", [True, False], ids=["stream", "no-stream"])
def test_logprobs_output_is_null_unless_logprobs_was_asked_for(server, stream_mode):
    without = stream(server.grpc_url, PROMPT, stream=stream_mode, sampling_parameters=GREEDY,
                     return_logprobs=True, return_cumulative_logprob=True)  # fmt: skip
    assert not without.errors
    assert all(json.loads(r.as_numpy("logprobs")[0]) is None for r in without.responses)
    cumulative = [float(r.as_numpy("cumulative_logprob")[0]) for r in without.responses]
    assert all(a != b for a, b in zip([0.0, *cumulative], cumulative, strict=False))  # new tokens each time
    asked = stream(server.grpc_url, PROMPT, stream=stream_mode, sampling_parameters={**GREEDY, "logprobs": 2},
                   return_logprobs=True, return_num_output_tokens=True)  # fmt: skip
    for response in asked.responses:
        positions = json.loads(response.as_numpy("logprobs")[0])
        assert len(positions) == int(response.as_numpy("num_output_tokens")[0])
        chosen = ""
        for position in positions:
            assert 1 <= len(position) <= 3
            ranks = [entry["rank"] for entry in position.values()]
            assert ranks.count(1) == 1
            assert all(set(entry) == {"logprob", "rank", "decoded_token"} for entry in position.values())
            chosen += next(e["decoded_token"] for e in position.values() if e["rank"] == 1)
        text = response.as_numpy("text_output")[0].decode()
        # not streaming, the prompt is echoed (exclude_input_in_output unset)
        assert (chosen if stream_mode else PROMPT + chosen) == text


def test_streaming_with_exclude_input_in_output_false_is_refused_with_vllm_backends_words(server):
    # ci/L0_backend_vllm/enabled_stream/enabled_stream_test.py at r24.10
    # (b71088af874878c2b734ca098422d8d48f502539)
    refused = stream(server.grpc_url, PROMPT, stream=True, exclude_input_in_output=False,
                     sampling_parameters=GREEDY)  # fmt: skip
    assert refused.errors == [
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    ]
    default = stream(server.grpc_url, PROMPT, stream=True, sampling_parameters=GREEDY)
    assert not default.errors and not default.text.startswith(PROMPT)


def test_boolean_logprobs_and_a_lora_name_get_clear_answers(server):
    sampled_only = stream(server.grpc_url, PROMPT, sampling_parameters={**GREEDY, "logprobs": True},
                          return_logprobs=True)  # fmt: skip
    [response] = sampled_only.responses
    assert all(len(position) == 1 for position in json.loads(response.as_numpy("logprobs")[0]))
    none = stream(
        server.grpc_url, PROMPT, sampling_parameters={**GREEDY, "logprobs": False}, return_logprobs=True
    )
    assert json.loads(none.responses[0].as_numpy("logprobs")[0]) is None
    # samples/client.py -l NAME (vllm_backend) sends lora_name
    lora = stream(server.grpc_url, PROMPT, sampling_parameters={**GREEDY, "lora_name": "mylora"})
    assert len(lora.errors) == 1 and "lora_name: LoRA adapter 'mylora' is not loaded" in lora.errors[0]


def test_a_cancelled_request_ends_cancelled_and_logs_vllm_backends_lines(server):
    # ci/L0_backend_vllm/request_cancellation/request_cancellation_test.py at r24.10
    # (f018d4a229862535b113ecaaf3f9d547f03000c9): the stream stopped with cancel_requests=True while
    # its request runs; one CANCELLED error, and the server log holds vllm_backend's two lines (that
    # test greps them). Upstream sends the request non-streaming; here it streams, so that the
    # request is seen running and the stub learns of the cancellation for certain (the poll or a
    # refused send): Triton 2.51 once never reported a non-streaming request's cancellation (1 run
    # of 9 on a loaded machine), and that request ran to its end.
    # A request can also outrun its cancellation: on a loaded 2-core machine the first response
    # reached the client after 0.1-3.8 s, while the engine went on generating (923 tokens in the
    # slowest case; one CI run had all 1,500 upstream tokens done before the cancel). So the request
    # asks for nearly the whole window, and an attempt whose FINAL went out as a success (counted in
    # paged_llm_final_responses_total) is repeated: what is tested is a cancellation that arrives
    # while the request runs.
    long = {"temperature": "0", "top_p": "1", "max_tokens": "4000", "ignore_eos": True}
    outcomes = []
    for _attempt in range(3):
        outcomes.append(_cancel_a_running_stream(server, long))
        if outcomes[-1] == "cancelled":
            break
    assert outcomes[-1] == "cancelled", outcomes
    assert stream(server.grpc_url, PROMPT, sampling_parameters=GREEDY).finals == 1


def _finals(server) -> dict[str, float]:
    text = server.metrics()
    return {
        code: value(text, "paged_llm_final_responses_total", code=code) for code in ("success", "cancelled")
    }


def _cancel_a_running_stream(server, sampling_parameters: dict) -> str:
    """One attempt: "cancelled" (and vllm_backend's log lines checked) or "outran the cancellation"."""
    log_before = server.log()
    finals_before = _finals(server)
    events: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer("llm", make_inputs("Write an original poem.", stream=True,
                              sampling_parameters=sampling_parameters), request_id="1")  # fmt: skip
    _result, error = events.get(timeout=60)
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    while (item := events.get(timeout=30))[1] is None:  # tokens that were on their way
        pass
    assert item[1].status() == "StatusCode.CANCELLED"
    assert events.empty()

    def final_delta() -> dict[str, float]:
        return {code: count - finals_before[code] for code, count in _finals(server).items()}

    assert wait_for(lambda: sum(final_delta().values()) >= 1, timeout_s=60), server.log()[-3000:]
    if final_delta()["cancelled"] == 0:  # only this test cancels: its request ended as a success
        return "outran the cancellation"

    def new_log() -> str:
        return server.log()[len(log_before) :]

    # (the CANCELLED error above is tritonclient's own, as upstream; the log lines are the server's)
    assert wait_for(lambda: "[vllm] Successfully cancelled the request" in new_log()), new_log()[-3000:]
    assert new_log().count("[vllm] Cancelling the request") == 1, new_log()[-3000:]
    assert new_log().count("[vllm] Successfully cancelled the request") == 1
    assert new_log().index("[vllm] Cancelling the request") < new_log().index("[vllm] Successfully")
    return "cancelled"

    assert stream(server.grpc_url, PROMPT, sampling_parameters=GREEDY).finals == 1


# Structured output as vllm_backend passes it to vLLM: ci/L0_backend_vllm/accuracy_test/accuracy_test.py
# (test_structured_outputs) at main (8de0c148bda1da25de1e05ffaaf67116dacc7264) sends
# `"structured_outputs": json.dumps({"choice": [...]})` inside `sampling_parameters`, and its
# src/utils/vllm_backend_utils.py makes StructuredOutputsParams(**json.loads(value)) of it; the object
# itself (not its JSON text) is accepted too. The tiny model is random: a constraint it can finish
# within max_tokens (bounded values only) shows the output is held to it.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
CONSTRAINED = {"temperature": 0, "max_tokens": 64}


def _checked(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    elif kind == "choice":
        assert text in ("yes", "no", "maybe"), text
    elif kind == "grammar":
        assert re.fullmatch(r"A[0-9][0-9]", text), text


STRUCTURED = {
    "json": ANSWER_SCHEMA,
    "regex": "[0-9]{3}-[a-z]{2}",
    "choice": ["yes", "no", "maybe"],
    "grammar": 'root ::= "A" [0-9] [0-9]',
}


@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_structured_outputs_over_grpc_streaming_and_http_generate_and_generate_stream(server, kind):
    params = {**CONSTRAINED, "structured_outputs": json.dumps({kind: STRUCTURED[kind]})}  # vllm_backend's
    streamed = stream(server.grpc_url, PROMPT, stream=True, sampling_parameters=params,
                      return_finish_reason=True)  # fmt: skip
    assert not streamed.errors and streamed.finals == 1
    assert streamed.last("finish_reason").tolist() == [b"stop"]  # the grammar ended it
    _checked(kind, streamed.text)
    params["structured_outputs"] = {kind: STRUCTURED[kind]}  # the object form
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(params), "exclude_input_in_output": True}
    status, whole = http_post(server.http_url, "/v2/models/llm/generate", body)
    assert status == 200, whole
    assert json.loads(whole)["text_output"] == streamed.text  # greedy: the same constrained tokens
    status, events = http_post(server.http_url, "/v2/models/llm/generate_stream", {**body, "stream": True})
    assert status == 200, events
    assert "".join(e["text_output"] for e in sse_events(events)) == streamed.text


def test_a_json_object_constraint_starts_an_object(server):
    """{"json_object": true}: the random model never closes it within max_tokens, but it opens one."""
    params = {**CONSTRAINED, "max_tokens": 8, "structured_outputs": {"json_object": True}}
    result = stream(server.grpc_url, PROMPT, stream=True, sampling_parameters=params)
    assert not result.errors and result.text.startswith("{"), result.text


@pytest.mark.parametrize(
    ("structured_outputs", "field"),
    [
        ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json/uniqueItems"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json/type"),
        ({"regex": "[0-9"}, "structured_outputs.regex"),  # found by the engine core's compile
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
    ],
    ids=["unenforceable-schema", "invalid-schema", "bad-regex", "bad-grammar", "no-choice"],
)
def test_a_bad_constraint_is_invalid_arg_naming_the_field_and_the_server_keeps_serving(
    server, structured_outputs, field
):
    params = {**CONSTRAINED, "structured_outputs": structured_outputs}
    refused = stream(server.grpc_url, PROMPT, stream=True, sampling_parameters=params)
    assert len(refused.errors) == 1 and not refused.responses, refused.errors
    assert f"{field}: " in refused.errors[0], refused.errors[0]
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(params)}
    status, text = http_post(server.http_url, "/v2/models/llm/generate", body)
    assert status == 400 and json.loads(text)["error"].startswith(f"{field}: "), (status, text)
    good = stream(server.grpc_url, PROMPT, sampling_parameters={**CONSTRAINED, "max_tokens": 4})
    assert not good.errors and good.finals == 1 and good.text
