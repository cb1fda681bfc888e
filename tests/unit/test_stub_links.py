"""Routing one engine step's outputs to the stubs that share the core (engine/engine_core/stub_links.py)."""

from __future__ import annotations

from paged_llm.engine.core_types import (
    EngineCoreOutputs,
    FinishedRequest,
    FinishedSequence,
)
from paged_llm.engine.engine_core.stub_links import split_outputs, stub_of
from paged_llm.sampling.token_logprobs import TokenLogprobs


def test_stub_of_reads_the_prefix_and_defaults_to_the_first():
    assert [stub_of(i) for i in ("7", "1:7", "12:0", "x:3", ":4")] == [0, 1, 12, 0, 0]


def test_split_outputs_routes_rows_finishes_logprobs_and_utility_results():
    logprobs = TokenLogprobs(-0.5, 1, [5], [-0.5])
    outputs = EngineCoreOutputs(
        request_ids=["0", "1:0", "1:0", "2:9"],
        seq_indices=[0, 0, 1, 0],
        new_token_ids=[11, 12, 13, 14],
        logprobs={2: logprobs},
        finished_sequences=[FinishedSequence("1:0", 1, "stop", 2)],
        finished_requests=[FinishedRequest("2:9")],
        utility_results={3: (True, "mine"), 1 << 40: (True, "theirs")},
        num_steps=5,
    )
    parts = split_outputs(outputs, {1 << 40: (2, 0)})
    assert sorted(parts) == [0, 1, 2]
    assert (parts[0].request_ids, parts[0].new_token_ids, parts[0].utility_results) == (
        ["0"],
        [11],
        {3: (True, "mine")},
    )
    assert (parts[1].request_ids, parts[1].seq_indices, parts[1].new_token_ids) == (
        ["1:0", "1:0"],
        [0, 1],
        [12, 13],
    )
    assert parts[1].logprobs == {1: logprobs}  # row 2 of the step is row 1 of stub 1's part
    assert parts[1].finished_sequences == outputs.finished_sequences
    assert parts[2].finished_requests == outputs.finished_requests
    assert parts[2].utility_results == {0: (True, "theirs")}  # under the stub's own call id
    assert all(p.num_steps == 5 for p in parts.values())


def test_split_outputs_always_has_a_part_for_the_first_stub():
    parts = split_outputs(EngineCoreOutputs(request_ids=["3:1"], seq_indices=[0], new_token_ids=[9]), {})
    assert sorted(parts) == [0, 3] and parts[0].is_empty


def test_split_outputs_routes_history_truncation_and_carries_session_stats():
    from paged_llm.core.sessions import SessionStats

    stats = SessionStats(2, 1, 0, 0, 1, 40)
    outputs = EngineCoreOutputs(history_truncated={"1:7": 12, "3": 5}, session_stats=stats)
    parts = split_outputs(outputs, {})
    assert parts[1].history_truncated == {"1:7": 12} and parts[0].history_truncated == {"3": 5}
    assert parts[0].session_stats is stats and parts[1].session_stats is stats
