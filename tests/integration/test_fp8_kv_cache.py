"""kv_cache_dtype fp8 on the tiny model (CPU, float32): the pool holds 4x the tokens of a float32
cache in the same bytes; the logits stay within a stated error of HF transformers' (float32, no
FP8); preemption, chunked prefill, prefix caching, asynchronous scheduling, n-gram speculation and
sessions give the tokens the FP8 engine gives each request alone."""

from __future__ import annotations

import pytest
import torch

from paged_llm.config import SessionConfig, SpeculativeConfig
from paged_llm.core.sessions import SessionTurn
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import make_engine, run_to_completion
from tests.integration.test_sessions import run_one, user_turns

# |engine - HF| log-probability of each generated token (HF: float32, no FP8), and how far the
# engine's greedy token may trail HF's best: e4m3 keeps 3 mantissa bits, so keys and values move by
# up to 1/16 of themselves. Measured over the 6 prompts x 12 tokens below (tiny-qwen3, scales 1.0,
# logits' std ~2): mean 0.06, worst 0.33, trail 0.17; a float32 cache: < 1e-4.
MEAN_LOGPROB_TOLERANCE = 0.1
WORST_LOGPROB_TOLERANCE = 0.5


def _greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def _alone(model_dir, prompts, params) -> list[list[int]]:
    """Each request on its own in an FP8 engine with room to spare (no preemption, no chunking)."""
    engine = make_engine(model_dir, kv_cache_dtype="fp8", enable_prefix_caching=False)
    try:
        return [run_to_completion(engine, [prompt], params)[0][0].token_ids for prompt in prompts]
    finally:
        engine.shutdown()


def test_the_pool_holds_four_times_the_tokens_of_float32(tiny_model_dir):
    sizes = {}
    for dtype in ("auto", "fp8"):
        engine = make_engine(tiny_model_dir, kv_cache_dtype=dtype, num_blocks=None, memory_bytes=8 << 20)
        sizes[dtype] = engine.info.num_kv_blocks
        engine.shutdown()
    assert sizes["fp8"] == 4 * sizes["auto"]


def test_logprobs_stay_within_the_stated_error_of_hf(tiny_model_dir, hf_reference, prompts):
    engine = make_engine(tiny_model_dir, kv_cache_dtype="fp8")
    chosen = prompts[:6]
    for index, prompt in enumerate(chosen):
        engine.add_request(f"r{index}", prompt, _greedy(12, logprobs=1))
    generated: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.sequences:
                generated.setdefault(output.request_id, []).extend(zip(delta.token_ids, delta.logprobs or []))
    engine.shutdown()
    errors, worst_trail = [], 0.0
    for index, prompt in enumerate(chosen):
        tokens = [token for token, _ in generated[f"r{index}"]]
        ids = torch.tensor([list(prompt) + tokens])
        with torch.no_grad():
            logits = hf_reference.model(ids).logits[0, len(prompt) - 1 : -1].float()
        reference = torch.log_softmax(logits, dim=-1)
        for position, (token, logprob) in enumerate(generated[f"r{index}"]):
            errors.append(abs(logprob.logprob - reference[position, token].item()))
            worst_trail = max(worst_trail, (reference[position].max() - reference[position, token]).item())
    mean_error = sum(errors) / len(errors)
    measured = f"mean {mean_error:.3f}, worst {max(errors):.3f}, trail {worst_trail:.3f}"
    assert mean_error <= MEAN_LOGPROB_TOLERANCE, measured
    assert max(errors) <= WORST_LOGPROB_TOLERANCE and worst_trail <= WORST_LOGPROB_TOLERANCE, measured
    assert mean_error > 1e-3, measured  # the FP8 rounding shows (a float32 cache matches HF to < 1e-4)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_chunking_and_prefix_caching_give_the_alone_tokens(
    tiny_model_dir, prompts, async_scheduling
):
    params = _greedy(10)
    chosen = list(prompts) + list(prompts[:3])  # repeats: their prompts hit the prefix cache
    expected = _alone(tiny_model_dir, chosen, params)
    engine = make_engine(
        tiny_model_dir,
        kv_cache_dtype="fp8",
        num_blocks=100,
        block_size_tokens=4,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    try:
        got = [completions[0].token_ids for completions in run_to_completion(engine, chosen, params)]
        stats = engine.scheduler_stats()
    finally:
        engine.shutdown()
    assert got == expected
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hit_tokens > 0


def test_ngram_speculation_gives_the_tokens_without_it(tiny_model_dir, prompts):
    repetitive = [list(prompt) * 3 for prompt in prompts[:4]]  # something for n-gram proposals to find
    params = _greedy(16)
    expected = _alone(tiny_model_dir, repetitive, params)
    engine = make_engine(
        tiny_model_dir, kv_cache_dtype="fp8", speculative=SpeculativeConfig(num_speculative_tokens=3)
    )
    try:
        got = [completions[0].token_ids for completions in run_to_completion(engine, repetitive, params)]
    finally:
        engine.shutdown()
    assert got == expected


def test_a_session_gives_the_tokens_of_stateless_requests(tiny_model_dir):
    session_engine = make_engine(tiny_model_dir, kv_cache_dtype="fp8", sessions=SessionConfig())
    stateless = make_engine(tiny_model_dir, kv_cache_dtype="fp8", enable_prefix_caching=False)
    try:
        history: list[int] = []
        turns = user_turns(session_engine.info.vocab_size)[:4]
        for index, new in enumerate(turns):
            params = _greedy(6)
            expected, _ = run_one(stateless, f"full{index}", history + new, params)
            turn = SessionTurn("chat", start=index == 0, end=index == len(turns) - 1)
            got, _ = run_one(session_engine, f"turn{index}", new, params, turn)
            assert got == expected, index
            history += new + got
    finally:
        session_engine.shutdown()
        stateless.shutdown()
