"""Sessions on the tiny model (CPU, float32, greedy): a multi-turn session gives the tokens of
stateless requests that carry the whole history, while computing only each turn's new tokens."""

from __future__ import annotations

import random

import pytest

from paged_llm.config import SessionConfig
from paged_llm.core.sessions import SessionTurn
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.engine.outputs import RequestOutput
from paged_llm.errors import InvalidRequestError, SessionNotFoundError
from paged_llm.sampling_params import SamplingParams

NUM_TURNS = 10


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_one(
    engine: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    session: SessionTurn | None = None,
) -> tuple[list[int], list[RequestOutput]]:
    engine.add_request(request_id, prompt, params, session=session)
    token_ids: list[int] = []
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.append(output)
            for delta in output.sequences:
                token_ids.extend(delta.token_ids)
        engine.check_integrity()
    assert outputs and outputs[-1].finished and outputs[-1].error is None
    return token_ids, outputs


def user_turns(vocab_size: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randrange(3, 20))] for _ in range(NUM_TURNS)]


@pytest.mark.parametrize("core_mode", ["inprocess", "process", "inprocess+async"])
def test_a_ten_turn_session_matches_stateless_requests_and_computes_only_new_tokens(engines, core_mode):
    session_engine = engines(core_mode)
    stateless = engines(enable_prefix_caching=False)  # every turn computed from scratch
    turns = user_turns(session_engine.info.vocab_size)
    history: list[int] = []
    for index, new in enumerate(turns):
        params = greedy(max_tokens=5 + index)
        expected, _ = run_one(stateless, f"full{index}", history + new, params)
        computed_before = session_engine.scheduler_stats().prompt_tokens_computed
        turn = SessionTurn("chat", start=index == 0, end=index == NUM_TURNS - 1)
        got, _ = run_one(session_engine, f"turn{index}", new, params, turn)
        assert got == expected, f"turn {index}"
        computed = session_engine.scheduler_stats().prompt_tokens_computed - computed_before
        # Only the new tokens, plus the previous turn's last output token (sampled, never fed back).
        assert computed == len(new) + (1 if index else 0), f"turn {index}"
        history += new + got
    assert session_engine.scheduler_stats().kv_usage == 0.0  # the last turn closed the session


@pytest.mark.parametrize("core_mode", ["inprocess", "inprocess+async", "process"])
def test_a_turn_ended_by_a_stop_string_extends_the_history(engines, core_mode):
    """Up to the token that completed the stop string, as a stop token would: the next turn equals a
    stateless request on that history and computes little more than its new tokens. (The stub
    finds stop strings; the core once ended such a turn as aborted and the history lost it. With
    asynchronous scheduling the core has run a step further by then: that token is dropped.)"""
    engine = engines(core_mode, block_size_tokens=4)
    stateless = engines(enable_prefix_caching=False)
    first, second = user_turns(engine.info.vocab_size, seed=5)[:2]
    probe = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, outputs = run_one(stateless, "probe", first, probe)
    text = "".join(delta.text for output in outputs for delta in output.sequences)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    got, outputs = run_one(engine, "turn0", first, params, SessionTurn("chat", start=True))
    [end] = [delta for output in outputs for delta in output.sequences if delta.finish_reason]
    assert end.finish_reason == "stop" and 0 < len(got) < 24
    follow_up = greedy(max_tokens=6)
    expected, _ = run_one(stateless, "full", first + got + second, follow_up)
    computed_before = engine.scheduler_stats().prompt_tokens_computed
    got_next, _ = run_one(engine, "turn1", second, follow_up, SessionTurn("chat", end=True))
    assert got_next == expected
    computed = engine.scheduler_stats().prompt_tokens_computed - computed_before
    assert computed <= len(second) + 1 + 4, computed  # at most a block recomputed besides the new tokens
    assert engine.scheduler_stats().kv_usage == 0.0


def test_a_truncated_turn_equals_a_fresh_request_on_the_truncated_history_and_says_so(engines):
    window = 64
    sinks = 4
    engine = engines(sessions=SessionConfig(session_window_tokens=window, num_sink_tokens=sinks))
    fresh = engines(enable_prefix_caching=False)
    turns = user_turns(engine.info.vocab_size, seed=11)
    history: list[int] = []
    truncated_turns = 0
    for index, new in enumerate(turns):
        params = greedy(max_tokens=8)
        prompt = history + new
        if len(prompt) + 8 > window:  # what the session must keep: sinks + the most recent tokens
            keep = window - 8
            prompt = prompt[:sinks] + prompt[len(prompt) - (keep - sinks) :]
        expected, _ = run_one(fresh, f"fresh{index}", prompt, params)
        got, outputs = run_one(engine, f"turn{index}", new, params, SessionTurn("s", start=index == 0))
        assert got == expected, f"turn {index}"
        dropped = len(history) + len(new) - len(prompt)
        assert outputs[0].history_truncated_tokens == (dropped or None)
        assert all(o.history_truncated_tokens is None for o in outputs[1:])
        truncated_turns += dropped > 0
        history = prompt + got
    assert truncated_turns >= 3


def test_errors_name_the_session_and_the_session_survives_them(engines):
    engine = engines()
    with pytest.raises(SessionNotFoundError, match="session_id: session 'ghost' is not open"):
        run_one(engine, "r0", [5, 6], greedy(4), SessionTurn("ghost"))
    run_one(engine, "r1", [5, 6], greedy(4), SessionTurn("s", start=True))
    with pytest.raises(InvalidRequestError, match="n: a session's turn has one sample"):
        engine.add_request("r2", [7], SamplingParams(n=2, max_tokens=4), session=SessionTurn("s"))
    engine.add_request("r3", [7, 8], greedy(30), session=SessionTurn("s"))
    engine.step()
    engine.abort_request("r3")  # cancelled mid-turn: the history is as before the turn
    tokens, _ = run_one(engine, "r4", [9], greedy(4), SessionTurn("s", end=True))
    assert len(tokens) == 4
    assert engine.scheduler_stats().kv_usage == 0.0
    engine.check_integrity()
