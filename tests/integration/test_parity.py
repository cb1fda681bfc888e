"""Token-exact greedy parity with HF transformers (float32, CPU) under every scheduling regime, with
the engine core stepped in this process and in its own process, each with asynchronous scheduling
(step N+1 launched before step N's tokens are on the host) forced on as well."""

from __future__ import annotations

import pytest

from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import run_to_completion

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(hf_reference, prompts) -> list[list[int]]:
    return [hf_reference.greedy(p, MAX_TOKENS) for p in prompts]


@pytest.fixture(params=["inprocess", "process", "inprocess+async", "process+async"])
def core_mode(request) -> str:
    return request.param


def _token_ids(results) -> list[list[int]]:
    return [completions[0].token_ids for completions in results]


def test_single_prompt_matches_hf(engines, core_mode, prompts, expected):
    engine = engines(core_mode)
    for prompt, want in zip(prompts[:4], expected[:4], strict=True):
        assert _token_ids(run_to_completion(engine, [prompt], GREEDY)) == [want]


def test_concurrent_requests_ample_kv_match_hf(engines, core_mode, prompts, expected):
    engine = engines(core_mode, num_blocks=4096)
    assert len(prompts) >= 16
    assert _token_ids(run_to_completion(engine, prompts, GREEDY)) == expected
    assert engine.scheduler_stats().num_preemptions_total == 0


def test_small_pool_preempts_and_still_matches_hf(engines, core_mode, prompts, expected):
    # 400 tokens of KV for ~1,000 tokens of demand; 4-token blocks so decodes need new blocks often.
    engine = engines(core_mode, num_blocks=100, block_size_tokens=4)
    assert _token_ids(run_to_completion(engine, prompts, GREEDY)) == expected
    assert engine.scheduler_stats().num_preemptions_total > 0


def test_prefix_caching_on_and_off_agree_on_shared_prefix(engines, core_mode, tiny_tokenizer, hf_reference):
    prefix = "You are a helpful assistant. Answer briefly and precisely. " * 8
    questions = ["What is a KV cache?", "Why batch requests?", "Name a prime.", "Is 7 odd?", "Say hi."]
    shared = [list(tiny_tokenizer(prefix + q, add_special_tokens=False)["input_ids"]) for q in questions]
    cached = engines(core_mode, enable_prefix_caching=True)
    # Run the first one alone so the others find its prefix in the cache.
    first = _token_ids(run_to_completion(cached, shared[:1], GREEDY))
    rest = _token_ids(run_to_completion(cached, shared[1:], GREEDY))
    uncached = _token_ids(run_to_completion(engines(core_mode, enable_prefix_caching=False), shared, GREEDY))
    assert first + rest == uncached
    assert uncached[0] == hf_reference.greedy(shared[0], MAX_TOKENS)
    assert cached.scheduler_stats().prefix_cache_hit_tokens >= 4 * (len(shared[0]) // 16 - 1) * 16
    # A prompt that is entirely cached still computes its last token and decodes correctly.
    again = _token_ids(run_to_completion(cached, shared[:1], GREEDY))
    assert again == first


def test_small_token_budget_forces_chunked_prefill(engines, core_mode, prompts, expected):
    engine = engines(core_mode, max_num_batched_tokens=32, max_num_seqs=8)
    longest = max(len(p) for p in prompts)
    assert longest > 32, "the budget must be smaller than the longest prompt"
    assert _token_ids(run_to_completion(engine, prompts, GREEDY)) == expected


def test_everything_small_at_once(engines, core_mode, prompts, expected):
    """Tight pool + tiny budget + few sequences + prefix caching: all interact, outputs still exact."""
    engine = engines(
        core_mode, num_blocks=104, block_size_tokens=4, max_num_batched_tokens=24, max_num_seqs=5
    )
    assert _token_ids(run_to_completion(engine, prompts, GREEDY)) == expected
