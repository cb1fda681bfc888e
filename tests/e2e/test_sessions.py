"""Sessions through a real tritonserver: turns over gRPC streams and HTTP generate give the tokens of
stateless requests carrying the whole history; unknown sessions are NOT_FOUND; a second concurrent
turn is refused; a cancelled turn leaves the session usable; idle sessions' KV gives way under
pressure; idle sessions expire; an unload with open sessions leaves nothing behind."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from paged_llm.paths import repo_root
from tests.e2e.client import http_post, make_inputs, stream_many
from tests.e2e.metrics import value, wait_for
from tests.e2e.server import RunningServer, make_model_repository, start_server
from tests.e2e.test_robustness import StreamClient, our_processes

VOCAB = 1000  # ids well inside the tiny model's vocabulary


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(count)]


def greedy(max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def output_ids(result) -> list[int]:
    return [int(t) for response in result.responses for t in response.as_numpy("output_ids").reshape(-1)]


def grpc_turn(url: str, new: list[int], max_tokens: int, **session) -> list[int]:
    result = stream_many(
        url, [make_inputs(new, sampling_parameters=greedy(max_tokens), stream=True, **session)]
    )[0]
    assert not result.errors and result.finals == 1, result.errors
    return output_ids(result)


def http_generate(server: RunningServer, prompt: list[int], max_tokens: int, **session) -> tuple[int, dict]:
    body = {"input_ids": prompt, "sampling_parameters": json.dumps(greedy(max_tokens)), **session}
    status, text = http_post(server.http_url, "/v2/models/llm/generate", body)
    return status, json.loads(text)


def http_turn(server: RunningServer, new: list[int], max_tokens: int, **session) -> list[int]:
    status, body = http_generate(server, new, max_tokens, **session)
    assert status == 200, body
    return list(body["output_ids"])


def test_a_session_over_grpc_streams_matches_stateless_requests(server):
    rng = random.Random(3)
    history: list[int] = []
    reused_before = value(server.metrics(), "paged_llm_session_reused_tokens_total")
    for index in range(8):
        new = ids(rng, rng.randrange(3, 25))
        session = {"session_id": "grpc-chat"}
        if index == 0:
            session["session_start"] = True
        got = grpc_turn(server.grpc_url, new, 6 + index, **session)
        expected = grpc_turn(server.grpc_url, history + new, 6 + index)
        assert got == expected, f"turn {index}"
        history += new + got
    assert http_turn(server, [], 1, session_id="grpc-chat", session_end=True) == []
    # Every turn after the first took the previous turns' KV (all but their last output token).
    assert wait_for(
        lambda: value(server.metrics(), "paged_llm_session_reused_tokens_total") - reused_before >= 7, 10
    )


def test_unknown_sessions_are_not_found_and_a_second_concurrent_turn_is_refused(server):
    not_found_before = value(server.metrics(), "paged_llm_final_responses_total", code="not_found")
    result = stream_many(server.grpc_url, [make_inputs([5, 6, 7], session_id="ghost")])[0]
    assert len(result.errors) == 1 and "session_id: session 'ghost' is not open" in result.errors[0]
    status, body = http_generate(server, [5, 6, 7], 4, session_id="ghost")
    # Triton 2.51's generate answers 400 for every error code but INTERNAL; the code itself is NOT_FOUND
    assert status == 400 and "session_id: session 'ghost' is not open" in body["error"], (status, body)
    assert wait_for(
        lambda: (
            value(server.metrics(), "paged_llm_final_responses_total", code="not_found")
            == not_found_before + 2
        ),
        10,
    )
    status, body = http_generate(server, [5], 4, session_start=True)
    assert status == 400 and "session_id: session_start and session_end need a session_id" in body["error"]

    rng = random.Random(5)
    first = ids(rng, 10)
    start_tokens = http_turn(server, first, 4, session_id="busy", session_start=True)
    # The long turn: streamed, ended by the client (cancel) once the refusal of the second was seen.
    cancelled_before = value(server.metrics(), "paged_llm_final_responses_total", code="cancelled")
    client = StreamClient(server.grpc_url)
    try:
        inputs = make_inputs(ids(rng, 5), session_id="busy", stream=True, sampling_parameters=greedy(4000))
        client.client.async_stream_infer("llm", inputs, request_id="long", enable_empty_final_response=True)
        result, error = client.next()
        assert error is None, error  # the first token: the turn is running
        status, body = http_generate(server, [9, 9], 4, session_id="busy")
        assert status == 400 and "session 'busy' already has a turn in flight" in body["error"], body
    finally:
        client.cancel()
    assert wait_for(  # the server saw the cancellation and ended the turn (it polls for them)
        lambda: (
            value(server.metrics(), "paged_llm_final_responses_total", code="cancelled") > cancelled_before
        ),
        30,
    )
    # The cancelled turn left the history as it was: the next turn continues from the first one.
    new = ids(rng, 6)
    got = http_turn(server, new, 5, session_id="busy", session_end=True)
    assert got == http_turn(server, first + start_tokens + new, 5)


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory) -> Iterator[RunningServer]:
    """A 40-block pool (640 tokens), sessions idle for 3 s expire, explicit model control."""
    root = tmp_path_factory.mktemp("sessions")
    parameters = {"num_kv_blocks": "40", "session_idle_ttl_s": "3"}
    repository = make_model_repository(root / "models", parameters, models=("llm",))
    running = start_server(
        repository, root / "server.log", ["--model-control-mode=explicit", "--load-model=llm"]
    )
    yield running
    running.stop()


def test_idle_sessions_give_their_kv_to_new_work_least_recently_used_first(tight_server):
    server = tight_server
    rng = random.Random(9)
    first_a, first_b = ids(rng, 200), ids(rng, 200)
    out_a = http_turn(server, first_a, 8, session_id="a", session_start=True)  # ~13 blocks held
    out_b = http_turn(server, first_b, 8, session_id="b", session_start=True)  # ~13 more
    evicted_before = value(server.metrics(), "paged_llm_session_kv_evictions_total")
    big = http_turn(server, ids(rng, 380), 8)  # 25 blocks: only with a session's KV reclaimed
    assert len(big) == 8
    assert wait_for(
        lambda: value(server.metrics(), "paged_llm_session_kv_evictions_total") > evicted_before, 10
    )
    new_a, new_b = ids(rng, 7), ids(rng, 7)
    got_a = http_turn(server, new_a, 6, session_id="a", session_end=True)  # recomputed from its history
    got_b = http_turn(server, new_b, 6, session_id="b", session_end=True)
    assert got_a == http_turn(server, first_a + out_a + new_a, 6)
    assert got_b == http_turn(server, first_b + out_b + new_b, 6)
    assert wait_for(lambda: value(server.metrics(), "paged_llm_kv_cache_usage_ratio") == 0.0, 10)
    assert wait_for(lambda: value(server.metrics(), "paged_llm_sessions_open") == 0.0, 10)


def test_an_idle_session_expires_after_its_ttl(tight_server):
    server = tight_server
    http_turn(server, [11, 12, 13], 2, session_id="ttl", session_start=True)
    time.sleep(4.0)  # more than session_idle_ttl_s (3 s): the next request finds it closed
    status, body = http_generate(server, [14], 2, session_id="ttl")
    assert status == 400 and "session 'ttl' is not open" in body["error"], body
    assert wait_for(lambda: value(server.metrics(), "paged_llm_sessions_expired_total") >= 1, 10)


def test_unloading_with_open_sessions_leaves_nothing_and_a_reload_starts_afresh(tight_server):
    server = tight_server
    http_turn(server, [21, 22, 23], 3, session_id="u1", session_start=True)
    http_turn(server, [24, 25], 3, session_id="u2", session_start=True)
    assert http_post(server.http_url, "/v2/repository/models/llm/unload", {})[0] == 200
    assert wait_for(lambda: our_processes(server) == {"stubs": [], "cores": []}, 60), server.log()[-5000:]
    assert http_post(server.http_url, "/v2/repository/models/llm/load", {}, timeout_s=120)[0] == 200
    status, body = http_generate(server, [26], 2, session_id="u1")
    assert status == 400 and "session 'u1' is not open" in body["error"], (
        body
    )  # sessions live in the engine: a reload starts without them
    assert http_turn(server, [27], 2, session_id="u1", session_start=True) != []


def test_the_terminal_chat_client_runs_a_session_and_closes_it(server):
    """clients/chat.py with its lines piped in: two turns of one session, closed at the end."""
    reused_before = value(server.metrics(), "paged_llm_session_reused_tokens_total")
    command = [
        sys.executable, str(repo_root() / "clients" / "chat.py"), "--url", server.grpc_url,
        "--temperature", "0", "--max-tokens", "5", "--params", json.dumps({"ignore_eos": True}),
    ]  # fmt: skip
    done = subprocess.run(
        command, input="Hello there\nAnd again\n/quit\n", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "[error" not in done.stderr, done.stderr
    # the second turn took the first turn's KV from the session
    assert wait_for(
        lambda: value(server.metrics(), "paged_llm_session_reused_tokens_total") > reused_before, 10
    )
    assert wait_for(lambda: value(server.metrics(), "paged_llm_sessions_open") == 0.0, 10)
