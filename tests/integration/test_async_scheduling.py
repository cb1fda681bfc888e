"""Asynchronous scheduling (step N+1 launched before step N's tokens are on the host) gives exactly
what synchronous scheduling gives, for every sampling feature, on the tiny model on CPU (where the
mode is forced on: `async_scheduling=on`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.sampling_params import SamplingParams


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple[int, float, list[int]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[Sample]]:
    results: dict[str, list[Sample]] = {}
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{index}", prompt, params)
        results[f"r{index}"] = [Sample() for _ in range(params.n)]
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            for delta in output.sequences:
                sample = results[output.request_id][delta.index]
                sample.token_ids.extend(delta.token_ids)
                sample.text += delta.text
                for position in delta.logprobs or ():
                    top_ids = [top.token_id for top in position.top]
                    sample.logprobs.append((position.token_id, position.logprob, top_ids))
                if delta.finish_reason is not None:
                    sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
        engine.check_integrity()
    assert engine.scheduler_stats().kv_usage == 0.0, "blocks still held after every request finished"
    return results


def assert_same_results(got: dict[str, list[Sample]], want: dict[str, list[Sample]]) -> None:
    """Equal tokens, text, finish and stop reasons and top-logprob ids; logprob values within 1e-3
    (batches differ in size between the modes, and kernels may round differently per size)."""
    assert got.keys() == want.keys()
    for request_id in want:
        for got_sample, want_sample in zip(got[request_id], want[request_id], strict=True):
            assert [(t, ids) for t, _, ids in got_sample.logprobs] == [
                (t, ids) for t, _, ids in want_sample.logprobs
            ], request_id
            for (_, got_value, _), (_, want_value, _) in zip(got_sample.logprobs, want_sample.logprobs):
                assert got_value == pytest.approx(want_value, abs=1e-3), request_id
            got_sample.logprobs = want_sample.logprobs = []
            assert got_sample == want_sample, request_id


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir, prompts) -> list[list[int]]:
    """Greedy tokens of the first prompts, synchronous scheduling (to place stops at known spots)."""
    from tests.integration.conftest import make_engine

    engine = make_engine(tiny_model_dir, async_scheduling="off")
    try:
        results = _run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in prompts[:4]])
    finally:
        engine.shutdown()
    return [results[f"r{i}"][0].token_ids for i in range(4)]


def _mixed_requests(prompts, greedy_reference, tokenizer) -> list[tuple[list[int], SamplingParams]]:
    stop_token = greedy_reference[0][5]
    stop_text = tokenizer.decode(greedy_reference[1][3:5])
    return [
        (prompts[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_token,))),
        (prompts[1], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop_text,))),
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=9, logprobs=3)),
        (prompts[3], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=10)),
        (prompts[4], SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=8)),
        (
            prompts[5],
            SamplingParams(
                temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=3, max_tokens=10
            ),
        ),
        (prompts[6], SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10)),
        (
            prompts[7],
            SamplingParams(temperature=0.0, max_tokens=7, min_tokens=7, stop_token_ids=(stop_token,)),
        ),
        (prompts[8], SamplingParams(temperature=0.0, max_tokens=1)),
        (prompts[9], SamplingParams(temperature=0.9, min_p=0.05, seed=5, max_tokens=14, logprobs=2)),
    ]


@pytest.mark.parametrize("small", [False, True], ids=["ample", "small-pool-and-budget"])
def test_async_scheduling_matches_sync_for_every_sampling_feature(
    engines, prompts, greedy_reference, tiny_tokenizer, small
):
    requests = _mixed_requests(prompts, greedy_reference, tiny_tokenizer)
    # The small set-up chunks prompts, preempts and serves prefixes from the cache.
    sizes = {"num_blocks": 48, "block_size_tokens": 4, "max_num_batched_tokens": 40, "max_num_seqs": 6}
    overrides = sizes if small else {}
    sync = _run(engines("inprocess", async_scheduling="off", **overrides), requests)
    engine = engines("inprocess", async_scheduling="on", **overrides)
    got = _run(engine, requests)
    assert_same_results(got, sync)
    assert engine.core.num_steps_launched_ahead > 0
    finish_reasons = {s.finish_reason for samples in got.values() for s in samples}
    assert finish_reasons == {"stop", "length"}, finish_reasons  # stops were exercised, not skipped
    if small:
        assert engine.scheduler_stats().num_preemptions_total > 0


def test_async_scheduling_waits_for_tokens_that_sampling_reads(engines, prompts):
    """Penalties read the previous tokens' values: such a step is never launched ahead."""
    engine = engines("inprocess", async_scheduling="on")
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=6)
    _run(engine, [(prompts[0], params)])
    assert engine.core.num_steps_launched_ahead == 0
    _run(engine, [(prompts[0], SamplingParams(temperature=0.0, max_tokens=6))])
    assert engine.core.num_steps_launched_ahead > 0


def test_abort_with_a_step_launched_ahead_frees_everything(engines, prompts):
    engine = engines("inprocess", async_scheduling="on")
    for index in range(4):
        engine.add_request(f"a{index}", prompts[index], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(6):
        engine.step()
    assert engine.core.has_in_flight_step
    for index in range(4):
        engine.abort_request(f"a{index}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # finishes the step still in flight; its tokens for aborted sequences are dropped
    engine.check_integrity()
    assert not engine.core.has_in_flight_step
    assert engine.scheduler_stats().kv_usage == 0.0


def test_a_failed_step_also_fails_the_step_launched_after_it_then_serving_goes_on(engines, prompts):
    """Step 3 fails when its tokens are read, with step 4 already launched on its KV: the requests
    of both fail (INTERNAL), nothing leaks, and a later request is served as usual."""
    engine = engines("inprocess", async_scheduling="on")
    core = engine.core
    launch = core.runner.launch

    def launch_with_a_fault(scheduler_output, previous=None):
        step = launch(scheduler_output, previous)
        if core.num_steps == 3:  # launch_step counted this step before calling the runner

            def fail():
                raise RuntimeError("device fault (test)")

            step.result = fail
        return step

    core.runner.launch = launch_with_a_fault
    params = SamplingParams(temperature=0.0, max_tokens=20)
    errors: dict[str, str] = {}
    engine.add_request("r0", prompts[0], params)
    for call in range(12):
        if call == 3:  # before the call that launches step 4 (and finishes step 3)
            engine.add_request("r1", prompts[1], params)
        for output in engine.step():
            if output.error is not None:
                errors[output.request_id] = str(output.error)
    assert set(errors) == {"r0", "r1"}, errors
    assert "device fault (test)" in errors["r0"] and "launched before step 3 failed" in errors["r1"]
    assert core.num_step_faults == 1
    assert not engine.has_unfinished_requests()
    later = _run(engine, [(prompts[2], SamplingParams(temperature=0.0, max_tokens=8))])
    assert len(later["r0"][0].token_ids) == 8


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_the_core_counts_its_busy_steps_by_kind(tiny_model_dir, async_scheduling):
    """A 40-token prompt in 16-token chunks, then 6 tokens: steps 2 and 3 are prefill periods (the
    first has no step before it), the 5 decodes after them decode periods, in both loop modes."""
    from tests.integration.conftest import make_engine

    engine = make_engine(tiny_model_dir, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        results = _run(engine, [(list(range(100, 140)), params)])
        assert len(results["r0"][0].token_ids) == 6
        steps = engine.stats.snapshot().engine_steps
        assert (steps.num_prefill_steps, steps.num_decode_steps) == (2, 5)
        assert steps.prefill_seconds > 0.0 and steps.decode_seconds > 0.0
        # A wait between requests is nobody's step: a second request's first step is not counted.
        short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        _run(engine, [(list(range(200, 204)), short)])
        steps = engine.stats.snapshot().engine_steps
        assert (steps.num_prefill_steps, steps.num_decode_steps) == (2, 7)
    finally:
        engine.shutdown()
