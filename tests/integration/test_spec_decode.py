"""Speculative decoding on the tiny model (CPU, float32), n-gram and draft-model proposers: greedy
outputs equal decoding one token at a time, for several k, under chunked prefill and under
preemption, with stops and length limits inside accepted runs; sampled outputs equal those without
speculation and do not depend on the batch; the per-request switch; the pause while nothing is
accepted; the KV of rejected proposals never reaches the prefix cache; the counters."""

from __future__ import annotations

import pytest

from paged_llm.config import SpeculativeConfig
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import run_to_completion


def spec(k: int, **overrides) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, **overrides)


@pytest.fixture(scope="module")
def spec_prompts(prompts) -> list[list[int]]:
    """The shared prompts plus copy-heavy ones (a passage repeated), where lookup finds matches."""
    passage = prompts[4][:24]
    return [*prompts[:10], passage * 3, passage[:5] * 6, [7, 8, 9] * 12]


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def token_ids(results) -> list[list[int]]:
    return [completion.token_ids for completions in results for completion in completions]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, spec_prompts) -> list[list[int]]:
    from tests.integration.conftest import make_engine

    return token_ids(run_to_completion(make_engine(tiny_model_dir), spec_prompts, GREEDY))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_outputs_equal_one_token_at_a_time(engines, spec_prompts, reference, k):
    engine = engines(speculative=spec(k))
    assert token_ids(run_to_completion(engine, spec_prompts, GREEDY)) == reference
    stats = engine.scheduler_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens <= k * stats.spec_num_drafts


def test_greedy_outputs_equal_under_chunked_prefill_and_preemption(engines, spec_prompts, reference):
    # 24 blocks of 16 tokens for 13 sequences of up to ~340 tokens: sequences are preempted and
    # recomputed; 48-token steps chunk every longer prompt.
    engine = engines(speculative=spec(4), num_blocks=24, max_num_batched_tokens=48)
    assert token_ids(run_to_completion(engine, spec_prompts, GREEDY)) == reference
    stats = engine.scheduler_stats()
    assert stats.num_preemptions_total > 0 and stats.spec_num_accepted_tokens > 0


def test_stops_and_length_limits_inside_an_accepted_run(engines, spec_prompts, reference):
    """Each request stops on a token it emits in the middle of its output (or runs to an odd
    max_tokens): the outputs end exactly where one-at-a-time decoding ends them."""
    params = []
    for index, expected in enumerate(reference):
        if index % 2:
            params.append(SamplingParams(max_tokens=7 + index, temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(expected[9],)))
    expected_outputs = token_ids(run_to_completion(engines(), spec_prompts, params))
    engine = engines(speculative=spec(5))
    assert token_ids(run_to_completion(engine, spec_prompts, params)) == expected_outputs
    assert engine.scheduler_stats().spec_num_accepted_tokens > 0


def test_rejected_proposals_leave_no_kv_in_the_prefix_cache(engines, spec_prompts, reference):
    """After speculative runs filled the prefix cache, the same requests served from that cache
    (speculation off) give the same tokens: every cached block holds the KV of its real tokens."""
    engine = engines(speculative=spec(4, prompt_lookup_min=1))
    run_to_completion(engine, spec_prompts, GREEDY)
    continued = [prompt + expected[:30] for prompt, expected in zip(spec_prompts, reference)]
    fresh = token_ids(run_to_completion(engines(), continued, GREEDY))
    off = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative_decoding=False)
    hits_before = engine.scheduler_stats().prefix_cache_hit_tokens
    assert token_ids(run_to_completion(engine, continued, off)) == fresh
    assert engine.scheduler_stats().prefix_cache_hit_tokens - hits_before > 30 * len(continued)


def test_sampled_outputs_are_reproducible_per_seed(engines, spec_prompts):
    params = [
        SamplingParams(max_tokens=30, temperature=0.5, top_k=3, top_p=0.95, seed=index, ignore_eos=True)
        for index in range(len(spec_prompts))
    ]
    first = engines(speculative=spec(3))
    runs = [token_ids(run_to_completion(first, spec_prompts, params))]
    # Again, in another batch order and with other requests alongside: the same tokens.
    second = engines(speculative=spec(3), max_num_batched_tokens=64)
    reordered = list(reversed(range(len(spec_prompts))))
    results = token_ids(
        run_to_completion(second, [spec_prompts[i] for i in reordered], [params[i] for i in reordered])
    )
    runs.append([results[reordered.index(i)] for i in range(len(spec_prompts))])
    assert runs[0] == runs[1]
    assert first.scheduler_stats().spec_num_accepted_tokens > 0
    # The same tokens as without speculation: each position takes the sampler's own draw there.
    assert runs[0] == token_ids(run_to_completion(engines(), spec_prompts, params))
    # The per-request switch: off, the request samples exactly as a server without speculation.
    off = [SamplingParams(**{**_fields(p), "speculative_decoding": False}) for p in params]
    spec_engine = engines(speculative=spec(3))
    assert token_ids(run_to_completion(spec_engine, spec_prompts, off)) == token_ids(
        run_to_completion(engines(), spec_prompts, params)
    )
    assert spec_engine.scheduler_stats().spec_num_drafts == 0


def _fields(params: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params) if f.name != "extra"}


def test_requests_that_need_one_token_at_a_time_do_not_speculate(engines, spec_prompts, reference):
    """logprobs and penalties: served without proposals, next to requests that speculate."""
    logprob_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = engines(speculative=spec(4))
    results = token_ids(run_to_completion(engine, spec_prompts[-3:], logprob_params))
    assert results == reference[-3:]
    assert engine.scheduler_stats().spec_num_drafts == 0
    mixed = [logprob_params, GREEDY, GREEDY]
    assert token_ids(run_to_completion(engine, spec_prompts[-3:], mixed)) == reference[-3:]
    assert engine.scheduler_stats().spec_num_drafts > 0


class _WrongProposer:
    """Proposes tokens the model (almost) never emits: nothing pays."""

    def propose(self, seqs, num_speculative_tokens: int) -> None:
        for seq in seqs:
            seq.spec_token_ids = [3] * num_speculative_tokens


@pytest.mark.parametrize("core_mode", ["inprocess", "inprocess+async"])
def test_proposing_pauses_while_nothing_is_accepted(engines, spec_prompts, reference, core_mode):
    """Never accepted: with speculative_pause_below each sequence verifies at its output steps 1, 3,
    6, 11, 20, 37 (pauses of 1, 2, 4, 8, 16 steps), not at every step; with launching ahead on (the
    GPU's default, forced here) the paused steps are launched ahead. Outputs stay exact."""
    prompts = spec_prompts[-4:]
    expected = reference[-4:]
    counts = {}
    for pause_below in (0.0, 0.5):
        engine = engines(core_mode, speculative=spec(4, speculative_pause_below=pause_below))
        engine.core.speculator.proposer = _WrongProposer()
        assert token_ids(run_to_completion(engine, prompts, GREEDY)) == expected
        counts[pause_below] = engine.scheduler_stats().spec_num_drafts
        if core_mode.endswith("async") and pause_below > 0:
            assert engine.core.num_steps_launched_ahead > 0
    # Every decoding step verified, but the last (its one token reaches max_tokens: nothing to verify).
    assert counts[0.0] == len(prompts) * (GREEDY.max_tokens - 2)
    assert counts[0.5] <= len(prompts) * 6


# ------------------------------------------------------------------------------------ draft model
def draft(model, k: int = 4, **overrides) -> SpeculativeConfig:
    return SpeculativeConfig(
        num_speculative_tokens=k, speculative_method="draft_model", speculative_model=str(model), **overrides
    )


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A random tiny Llama with the tiny Qwen3's vocabulary: a draft that is mostly wrong."""
    from paged_llm.models.random_model import write_random_model

    return write_random_model(
        tmp_path_factory.mktemp("draft") / "tiny-llama", "tiny-llama", "float32", seed=5
    )


def test_the_model_as_its_own_draft_is_accepted_and_exact(engines, tiny_model_dir, spec_prompts, reference):
    engine = engines(speculative=draft(tiny_model_dir, k=4))
    assert token_ids(run_to_completion(engine, spec_prompts, GREEDY)) == reference
    stats = engine.scheduler_stats()
    assert stats.spec_num_draft_tokens > 100
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens


def test_a_draft_model_under_chunked_prefill_and_preemption(engines, tiny_model_dir, spec_prompts, reference):
    """The draft's KV lives in the target's blocks: preempted sequences start their draft over,
    chunked prompts are caught up across steps; the tokens stay exact."""
    engine = engines(speculative=draft(tiny_model_dir, k=3), num_blocks=24, max_num_batched_tokens=48)
    assert token_ids(run_to_completion(engine, spec_prompts, GREEDY)) == reference
    stats = engine.scheduler_stats()
    assert stats.num_preemptions_total > 0 and stats.spec_num_accepted_tokens > 0


def test_a_wrong_draft_model_changes_no_token(engines, other_draft, spec_prompts, reference):
    engine = engines(speculative=draft(other_draft, k=3, speculative_pause_below=0.0))
    assert token_ids(run_to_completion(engine, spec_prompts, GREEDY)) == reference
    stats = engine.scheduler_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens < 0.5 * stats.spec_num_draft_tokens


def test_draft_model_sampling_is_reproducible_per_seed(engines, tiny_model_dir, spec_prompts):
    params = [
        SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=index, ignore_eos=True)
        for index in range(len(spec_prompts))
    ]
    first = token_ids(run_to_completion(engines(speculative=draft(tiny_model_dir)), spec_prompts, params))
    order = list(reversed(range(len(spec_prompts))))
    second = engines(speculative=draft(tiny_model_dir), max_num_batched_tokens=64)
    results = token_ids(
        run_to_completion(second, [spec_prompts[i] for i in order], [params[i] for i in order])
    )
    assert first == [results[order.index(i)] for i in range(len(spec_prompts))]
    assert second.scheduler_stats().spec_num_accepted_tokens > 0
    # Each position takes the token the sampler draws there without speculation.
    assert first == token_ids(run_to_completion(engines(), spec_prompts, params))


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    import json
    import shutil

    from paged_llm.config import ConfigError
    from tests.integration.conftest import make_engine

    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(tiny_model_dir, speculative=draft(other))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_session_with_speculation_gives_the_tokens_of_stateless_requests(engines, tiny_model_dir, method):
    """A session's turns hold their KV between turns; blocks a turn reserved for proposals go with
    it. Each turn equals a stateless request on the whole history, computing only the new tokens."""
    from paged_llm.core.sessions import SessionTurn
    from tests.integration.test_sessions import run_one, user_turns

    speculative = spec(4) if method == "ngram" else draft(tiny_model_dir, k=3)
    session_engine = engines(speculative=speculative)
    stateless = engines(enable_prefix_caching=False)
    history: list[int] = []
    turns = user_turns(session_engine.info.vocab_size)
    for index, new in enumerate(turns):
        params = SamplingParams(temperature=0.0, max_tokens=12 + index, ignore_eos=True)
        expected, _ = run_one(stateless, f"full{index}", history + new, params)
        computed_before = session_engine.scheduler_stats().prompt_tokens_computed
        turn = SessionTurn("chat", start=index == 0, end=index == len(turns) - 1)
        got, _ = run_one(session_engine, f"turn{index}", new, params, turn)
        assert got == expected, f"turn {index}"
        computed = session_engine.scheduler_stats().prompt_tokens_computed - computed_before
        assert computed == len(new) + (1 if index else 0), f"turn {index}"
        history += new + got
    assert session_engine.scheduler_stats().spec_num_accepted_tokens > 0
    assert session_engine.scheduler_stats().kv_usage == 0.0


class _BrokenProposer:
    def __init__(self) -> None:
        self.calls = 0

    def propose(self, seqs, num_speculative_tokens: int) -> None:
        self.calls += 1
        for seq in seqs:
            seq.spec_token_ids = [3] * num_speculative_tokens
        raise RuntimeError("the draft model fell over")


def test_a_failing_proposer_costs_its_proposals_only(engines, spec_prompts, reference):
    engine = engines(speculative=spec(4))
    broken = _BrokenProposer()
    engine.core.speculator.proposer = broken
    assert token_ids(run_to_completion(engine, spec_prompts, GREEDY)) == reference
    assert broken.calls > 0 and engine.core.speculator.num_proposer_faults == broken.calls
    assert engine.scheduler_stats().spec_num_drafts == 0
