"""Speculative decoding through tritonserver: a server with `num_speculative_tokens` set streams the
same greedy tokens as the default server, reports its proposals in /metrics, honours the
per-request `speculative_decoding` switch and names the field of a bad value."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.client import make_inputs, stream, stream_many
from tests.e2e.metrics import settled_metrics, value, wait_for, wait_idle
from tests.e2e.server import RunningServer, make_model_repository, start_server

GREEDY = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("spec")
    repository = make_model_repository(root / "models", {"num_speculative_tokens": "4"}, models=("llm",))
    running = start_server(repository, root / "server.log")
    yield running
    running.stop()


def _prompts(prompts: list[list[int]]) -> list[list[int]]:
    passage = prompts[4][:20]
    return [passage * 3, [7, 8, 9] * 12, prompts[1], prompts[8][:60]]


def _output_ids(results) -> list[list[int]]:
    return [[int(t) for r in result.responses for t in r.as_numpy("output_ids")] for result in results]


def test_streams_the_tokens_of_the_default_server_and_counts_its_proposals(server, spec_server, prompts):
    requests = [make_inputs(p, stream=True, sampling_parameters=GREEDY) for p in _prompts(prompts)]
    expected = stream_many(server.grpc_url, requests)
    before = spec_server.metrics()
    got = stream_many(spec_server.grpc_url, requests)
    assert all(not r.errors and r.finals == 1 for r in [*expected, *got])
    assert _output_ids(got) == _output_ids(expected)
    assert all(len(ids) == GREEDY["max_tokens"] for ids in _output_ids(got))

    counters = tuple(
        f"paged_llm_spec_decode_num_{name}_total" for name in ("drafts", "draft_tokens", "accepted_tokens")
    )
    accepted = counters[2]
    assert wait_for(lambda: value(spec_server.metrics(), accepted) > value(before, accepted), timeout_s=10)
    after = settled_metrics(spec_server, counters)
    drafts, draft_tokens, accepted_tokens = (value(after, name) - value(before, name) for name in counters)
    assert drafts > 0 and draft_tokens >= accepted_tokens > 0
    text = spec_server.metrics()
    assert 0 < value(text, "paged_llm_spec_decode_acceptance_rate") <= 1
    assert value(text, "paged_llm_spec_decode_mean_accepted_length") > 1
    wait_idle(spec_server)


def test_the_per_request_switch_and_a_bad_value(spec_server, prompts):
    prompt = _prompts(prompts)[1]
    before = value(spec_server.metrics(), "paged_llm_spec_decode_num_drafts_total")
    off = stream(spec_server.grpc_url, prompt, sampling_parameters={**GREEDY, "speculative_decoding": False})
    on = stream(spec_server.grpc_url, prompt, sampling_parameters=GREEDY)
    assert not off.errors and not on.errors
    assert (
        off.responses[-1].as_numpy("output_ids").tolist() == on.responses[-1].as_numpy("output_ids").tolist()
    )
    assert wait_for(
        lambda: value(spec_server.metrics(), "paged_llm_spec_decode_num_drafts_total") > before, timeout_s=10
    )
    bad = stream(
        spec_server.grpc_url, prompt, sampling_parameters={**GREEDY, "speculative_decoding": "maybe"}
    )
    assert bad.finals == 1 and len(bad.errors) == 1 and "speculative_decoding" in bad.errors[0]
    wait_idle(spec_server)
