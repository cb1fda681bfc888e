"""Engine behaviour on the tiny model (CPU): sampling, stops, n > 1, aborts, faults, and the serving
stub (AsyncLLM) over a core in a thread and in its own process."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from paged_llm.config import CacheConfig, EngineConfig, ModelConfig
from paged_llm.engine.async_llm import AsyncLLM
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.errors import InvalidRequestError, QueueFullError, RequestAbortedError
from paged_llm.sampling_params import RequestLimits, SamplingParams
from tests.integration.conftest import make_engine, run_to_completion


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


def greedy(max_tokens: int | None = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_seeded_sampling_does_not_depend_on_the_batch(engine, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=42)
    alone = run_to_completion(engine, [prompts[1]], params)[0][0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, seed=i) for i in range(5)]
    batch = run_to_completion(
        engine, [prompts[3], prompts[1], *prompts[4:8]], [others[0], params, *others[1:]]
    )
    assert batch[1][0].token_ids == alone
    different_seed = run_to_completion(
        engine, [prompts[1]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=43)
    )
    assert different_seed[0][0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(engine, tiny_tokenizer):
    prompt = list(tiny_tokenizer("A long shared prompt for several samples. " * 5)["input_ids"])
    kv_cache = engine.core.kv_cache
    hits_before = kv_cache.num_prefix_hit_tokens
    [samples] = run_to_completion(
        engine, [prompt], SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7)
    )
    assert len(samples) == 4 and all(len(s.token_ids) == 10 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1, "samples with derived seeds should differ"
    full_blocks = (len(prompt) - 1) // kv_cache.block_size_tokens
    assert kv_cache.num_prefix_hit_tokens - hits_before >= 3 * full_blocks * kv_cache.block_size_tokens
    [again] = run_to_completion(engine, [prompt], SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7))
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]


def test_stop_string_truncates_text_and_reports_stop(engine, prompts, tiny_tokenizer):
    [[full]] = run_to_completion(engine, [prompts[1]], greedy(24))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "pick a non-blank stop string"
    [[stopped]] = run_to_completion(engine, [prompts[1]], greedy(24, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    [[included]] = run_to_completion(
        engine, [prompts[1]], greedy(24, stop=(stop,), include_stop_str_in_output=True)
    )
    assert included.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_id_ends_generation(engine, prompts, tiny_tokenizer):
    [[full]] = run_to_completion(engine, [prompts[2]], greedy(20))
    stop_token = full.token_ids[5]
    first = full.token_ids.index(stop_token)
    [[stopped]] = run_to_completion(engine, [prompts[2]], greedy(20, stop_token_ids=(stop_token,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.text == tiny_tokenizer.decode(full.token_ids[:first])


def test_max_model_len_ends_with_length(tiny_model_dir, prompts):
    prompt = prompts[1]
    engine = make_engine(tiny_model_dir, max_model_len=len(prompt) + 5)
    [[completion]] = run_to_completion(engine, [prompt], greedy(None))  # until max_model_len
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"


def test_logprobs_match_hf_scores(engine, hf_reference, prompts):
    prompt = prompts[4]
    [[completion]] = run_to_completion(engine, [prompt], greedy(6, logprobs=3))
    ids = torch.tensor([prompt])
    out = hf_reference.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    engine_run = engine  # the same engine returns logprobs through its outputs
    engine_run.add_request("lp", prompt, greedy(6, logprobs=3))
    positions = []
    while engine_run.has_unfinished_requests():
        for output in engine_run.step():
            positions.extend(output.sequences[0].logprobs or [])
    assert len(positions) == 6
    for position, logits in zip(positions, out.logits, strict=True):
        reference = torch.log_softmax(logits[0].float(), dim=-1)
        assert position.rank == 1
        assert position.logprob == pytest.approx(reference[position.token_id].item(), abs=1e-4)
        top = torch.topk(reference, 3)
        assert [t.token_id for t in position.top] == top.indices.tolist()
        assert [t.rank for t in position.top] == [1, 2, 3]
    assert completion.token_ids == [p.token_id for p in positions]


def test_abort_frees_blocks_and_reports_abort(engine, prompts):
    engine.add_request("to-abort", prompts[8], greedy(50))
    engine.step()
    assert engine.core.kv_cache.usage > 0
    final = engine.abort_request("to-abort")
    assert final is not None and final.finished
    assert final.sequences[0].finish_reason == "abort"
    assert engine.core.kv_cache.usage == 0 and not engine.has_unfinished_requests()
    engine.check_integrity()


def test_invalid_prompts_are_rejected_with_numbers(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="the prompt has 64 tokens but max_model_len is 64"):
        engine.add_request("long", [1] * 64, greedy())
    with pytest.raises(InvalidRequestError, match=r"token id 151936 is outside the vocabulary \[0, 151936\)"):
        engine.add_request("oov", [1, 151936], greedy())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], greedy())
    assert not engine.has_unfinished_requests()


def test_a_prompt_larger_than_the_pool_is_rejected(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=4, block_size_tokens=4, max_model_len=64)
    assert engine.max_model_len == 16  # lowered to what the pool can hold
    with pytest.raises(InvalidRequestError, match="max_model_len is 16"):
        engine.add_request("big", [1] * 20, greedy())


def test_admission_policy_reject_refuses_beyond_max_num_seqs_and_accepts_again(tiny_model_dir, prompts):
    engine = make_engine(tiny_model_dir, max_num_seqs=3, admission_policy="reject")
    engine.add_request("a", prompts[1], greedy(4))
    engine.add_request("b", prompts[2], greedy(4, n=2))  # 3 sequences live: at capacity
    with pytest.raises(QueueFullError, match=r"at capacity \(3 of max_num_seqs=3 sequences live"):
        engine.add_request("c", prompts[3], greedy(4))
    assert engine.core.num_unfinished_requests == 2  # the refused one never reached the queue
    while engine.has_unfinished_requests():
        engine.step()
    [[after]] = run_to_completion(engine, [prompts[3]], greedy(4))  # capacity is back
    assert after.finish_reason == "length" and engine.core.kv_cache.usage == 0
    with pytest.raises(InvalidRequestError, match="n: 4 samples can never run at once"):
        engine.add_request("too-wide", prompts[3], greedy(4, n=4))  # a request error, not load


def test_queue_max_wait_ends_a_request_that_never_started_but_not_a_running_one(tiny_model_dir, prompts):
    engine = make_engine(tiny_model_dir, max_num_seqs=1, queue_max_wait_s=30.0)
    engine.add_request("running", prompts[1], greedy(6))
    engine.step()  # "running" starts and holds the only slot
    # "stale" arrived 60 s ago (longer than queue_max_wait_s) and cannot start while "running" runs.
    engine.add_request("stale", prompts[2], greedy(6), arrival_time=time.monotonic() - 60.0)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_integrity()
    stale = finals["stale"]
    assert isinstance(stale.error, QueueFullError)
    assert "in the queue without starting, more than queue_max_wait_s=30" in str(stale.error)
    assert not any(delta.token_ids for delta in stale.sequences)  # it never ran
    assert finals["running"].error is None
    assert finals["running"].sequences[0].finish_reason == "length"
    assert engine.core.kv_cache.usage == 0


def test_max_tokens_cap_bounds_a_request_that_asks_until_max_model_len(tiny_model_dir, prompts):
    """max_tokens null (what the OpenAI server sends for a chat without max_tokens) runs to the
    context's end, within max_tokens_cap: the core applies the cap once it knows the prompt."""
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64),
        cache=CacheConfig(num_blocks=256),
        limits=RequestLimits(max_tokens=5),
    )
    engine = LLMEngine(config, show_progress=False)
    until_the_end = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    [[capped]] = run_to_completion(engine, [prompts[1]], until_the_end)
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length"
    uncapped = LLMEngine(replace(config, limits=RequestLimits()), show_progress=False)
    [[whole]] = run_to_completion(uncapped, [prompts[1]], until_the_end)
    assert len(whole.token_ids) == 64 - len(prompts[1]) and whole.finish_reason == "length"


def test_injected_step_fault_fails_in_flight_requests_and_engine_recovers(tiny_model_dir, prompts):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=512),
        fault_injection_step=2,
    )
    engine = LLMEngine(config, show_progress=False)
    for index in range(3):
        engine.add_request(f"f{index}", prompts[index + 1], greedy(8))
    engine.step()
    failed = [o for o in engine.step() if o.finished]  # the step also delivers step 1's tokens
    assert sorted(o.request_id for o in failed) == ["f0", "f1", "f2"]
    assert all(o.finished and o.error is not None and "injected fault" in str(o.error) for o in failed)
    assert not any("RuntimeError" in str(o.error) for o in failed)  # (the client's text: no class name)
    assert engine.core.kv_cache.usage == 0 and not engine.core.kv_cache.pool.cached_blocks
    [[after]] = run_to_completion(engine, [prompts[1]], greedy(8))
    assert len(after.token_ids) == 8 and after.finish_reason == "length"


@pytest.mark.parametrize("core_mode", ["thread", "process"])
def test_async_engine_serves_threads_and_shutdown_aborts_the_rest(tiny_model_dir, prompts, core_mode):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"), cache=CacheConfig(num_blocks=512)
    )
    done: dict[str, list] = {}
    finished = threading.Event()
    lock = threading.Lock()

    def on_outputs(outputs):
        with lock:
            for output in outputs:
                done.setdefault(output.request_id, []).append(output)
            if len([k for k, v in done.items() if v[-1].finished]) == 8:
                finished.set()

    engine = AsyncLLM(config, on_outputs, core_mode=core_mode)
    try:
        threads = [
            threading.Thread(target=engine.add_request, args=(f"t{i}", prompts[i], greedy(8)))
            for i in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert finished.wait(60)
        assert all(sum(o.finished for o in outputs) == 1 for outputs in done.values())
        assert all(sum(len(o.sequences[0].token_ids) for o in outputs) == 8 for outputs in done.values())
        engine.add_request("long", prompts[1], greedy(4000, ignore_eos=True))
    finally:
        engine.shutdown(grace_s=0.2)
    final = done["long"][-1]
    assert final.finished and isinstance(final.error, RequestAbortedError)
    assert final.sequences[0].finish_reason == "abort"
    assert [o.finished for o in done["long"]].count(True) == 1
    assert engine.stats.snapshot().num_running == 0


def test_bad_words_are_never_generated_and_match_hf_bad_words_ids(
    engine, hf_reference, prompts, tiny_tokenizer
):
    """vLLM's bad_words: a word from the greedy output is banned (both its spellings, with and without
    a leading space); greedy decoding then equals HF generate with the same token sequences as
    bad_words_ids (HF matches prefixes against prompt + output, we against the output, as vLLM
    does: the banned words here start inside the output)."""
    prompt = prompts[3]
    [[full]] = run_to_completion(engine, [prompt], greedy(24))
    single = full.token_ids[4]  # a one-token bad word: banned at every step
    pair = tuple(full.token_ids[8:10])  # a two-token one: its second token banned after its first
    words = (tiny_tokenizer.decode([single]), tiny_tokenizer.decode(list(pair)))
    assert all(w.strip() for w in words), words
    params = greedy(24, bad_words=words)
    [[banned]] = run_to_completion(engine, [prompt], params)
    tokenized = [
        tuple(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
        for word in words
        for text in (word.lstrip(), " " + word.lstrip())
    ]
    for sequence in tokenized:
        for start in range(len(banned.token_ids) - len(sequence) + 1):
            assert tuple(banned.token_ids[start : start + len(sequence)]) != sequence
    assert banned.token_ids != full.token_ids
    reference = hf_reference.greedy(prompt, 24, bad_words_ids=[list(s) for s in dict.fromkeys(tokenized)])
    assert banned.token_ids == reference


def test_bad_words_are_checked(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams.from_mapping({"bad_words": ["  "]})
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams.from_mapping({"bad_words": [7]})
    with pytest.raises(InvalidRequestError, match="bad_words_token_ids"):
        SamplingParams.from_mapping({"bad_words_token_ids": [[1, 2]]})  # internal, not a client's
