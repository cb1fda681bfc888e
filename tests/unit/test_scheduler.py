"""Scheduler: admission order, token budget and chunked prefill, priorities, preemption by recompute,
stop conditions, aborts and prefix-cache hits, driven step by step with a fake model; plus a
property-based test of random workloads on a tiny KV pool.

The fake model samples `model_token(seq_id, index)` where index = len(output_token_ids) at sampling
time. It depends on nothing else, so a sequence recomputed after preemption must end with exactly the
tokens it would have produced without preemption: a duplicated or dropped token changes the sequence.
"""

from __future__ import annotations

import random
import zlib
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.config import SchedulerConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput, SequenceUpdate
from paged_llm.sampling_params import SamplingParams
from paged_llm.sequence import PENDING_TOKEN, Sequence, SequenceStatus

BLOCK = 4

Model = Callable[[Sequence], int]
StepSummary = list[tuple[str, int, int, bool]]  # (seq_id, start, num_new_tokens, needs_sample)


def model_token(seq_id: str, index: int, vocab: int = 1000) -> int:
    """The fake model's output: a fixed function of the sequence and the output index (>= 5000 by
    default so it never collides with the small EOS / stop ids the tests script)."""
    return zlib.crc32(f"{seq_id}:{index}".encode()) % vocab + (5000 if vocab == 1000 else 0)


def fake_model(seq: Sequence) -> int:
    return model_token(seq.seq_id, seq.num_output_tokens)


def scripted_model(script: dict[int, int]) -> Model:
    """Emits script[index] at the given output indices and the fake model's token elsewhere."""

    def model(seq: Sequence) -> int:
        return script.get(seq.num_output_tokens, fake_model(seq))

    return model


def prompt_tokens(seq_id: str, length: int) -> list[int]:
    """Distinct per sequence, so tests get prefix-cache hits only where they ask for them."""
    return [zlib.crc32(f"{seq_id}/{i}".encode()) % 30000 + 100 for i in range(length)]


def make_sequence(
    seq_id: str,
    prompt: int | abc.Sequence[int],
    *,
    eos: abc.Sequence[int] = (),
    **params: Any,
) -> Sequence:
    tokens = prompt_tokens(seq_id, prompt) if isinstance(prompt, int) else list(prompt)
    params.setdefault("max_tokens", 4)
    return Sequence(
        seq_id=seq_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(**params),
        seed=0,
        eos_token_ids=frozenset(eos),
    )


def make_scheduler(
    num_blocks: int = 32,
    *,
    max_num_seqs: int = 8,
    budget: int = 64,
    caching: bool = True,
    chunked: bool = True,
    max_model_len: int | None = None,
    block_size: int = BLOCK,
    prefill_cap: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        max_prefill_tokens_while_decoding=prefill_cap,
    )
    return Scheduler(config, kv, max_model_len or num_blocks * block_size)


def summary(output: SchedulerOutput) -> StepSummary:
    return [(s.seq_id, s.num_computed_tokens, s.num_new_tokens, s.needs_sample) for s in output.scheduled]


def schedule(sched: Scheduler) -> SchedulerOutput:
    output = sched.schedule()
    sched.check_integrity()
    assert output.num_batched_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_batched_tokens <= sched.config.max_num_batched_tokens
    return output


Updates = list[SequenceUpdate]


def apply(sched: Scheduler, output: SchedulerOutput, model: Model = fake_model) -> Updates:
    sampled = {s.seq_id: model(s.seq) for s in output.scheduled if s.needs_sample}
    updates = sched.update_from_output(output, sampled)
    sched.check_integrity()
    return updates


def step(sched: Scheduler, model: Model = fake_model) -> SchedulerOutput:
    output = schedule(sched)
    apply(sched, output, model)
    return output


def run(sched: Scheduler, model: Model = fake_model, max_steps: int = 500) -> list[StepSummary]:
    """Steps until every sequence finished; returns each step's summary."""
    steps = []
    while sched.has_unfinished_sequences():
        assert len(steps) < max_steps, "no progress"
        steps.append(summary(step(sched, model)))
    return steps


def expected_outputs(seq_id: str, count: int) -> list[int]:
    return [model_token(seq_id, i) for i in range(count)]


def assert_all_freed(sched: Scheduler) -> None:
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.seq_to_blocks == {} and kv.num_cached_blocks == {}
    assert sched.sequences == {} and sched.running == [] and sched.waiting == []


# ------------------------------------------------------------------------------------- admission
def test_fcfs_admission_within_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (make_sequence(rid, 4, max_tokens=2) for rid in "abc")
    for seq in (a, b, c):
        sched.add_sequence(seq)
    assert [r.arrival_seq for r in (a, b, c)] == [0, 1, 2]

    assert summary(step(sched)) == [("a", 0, 4, True), ("b", 0, 4, True)]
    assert [r.seq_id for r in sched.waiting] == ["c"]
    assert summary(step(sched)) == [("a", 4, 1, True), ("b", 4, 1, True)]  # both reach max_tokens=2
    assert a.status is b.status is SequenceStatus.FINISHED_LENGTH
    assert summary(step(sched)) == [("c", 0, 4, True)]
    assert run(sched) == [[("c", 4, 1, True)]]
    assert a.output_token_ids == expected_outputs("a", 2)
    assert_all_freed(sched)


def test_waiting_head_is_not_overtaken_when_it_does_not_fit() -> None:
    sched = make_scheduler(num_blocks=8)  # 32 tokens
    big = make_sequence("big", 20, max_tokens=2)  # 5 blocks (6 with its outputs)
    blocked = make_sequence("blocked", 16)  # 4 blocks: only 3 left
    small = make_sequence("small", 4)  # 1 block: would fit, but arrived later
    for seq in (big, blocked, small):
        sched.add_sequence(seq)
    assert summary(step(sched)) == [("big", 0, 20, True)]
    assert [r.seq_id for r in sched.waiting] == ["blocked", "small"]
    assert summary(step(sched)) == [("big", 20, 1, True)]  # finishes
    assert summary(step(sched)) == [("blocked", 0, 16, True), ("small", 0, 4, True)]


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=3)
    for rid in "abcde":
        sched.add_sequence(make_sequence(rid, 3, max_tokens=3))
    first_seen: list[str] = []
    while sched.has_unfinished_sequences():
        output = step(sched)
        assert len(output.scheduled) <= 3
        assert len(sched.running) <= 3
        first_seen += [s.seq_id for s in output.scheduled if s.seq_id not in first_seen]
    assert first_seen == list("abcde")
    assert_all_freed(sched)


# ------------------------------------------------------------------------ budget, chunked prefill
def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    sched = make_scheduler(budget=8)
    seq = make_sequence("a", 20, max_tokens=2)
    sched.add_sequence(seq)

    first = step(sched)
    assert summary(first) == [("a", 0, 8, False)]
    assert first.scheduled[0].block_ids == [0, 1]
    assert seq.num_computed_tokens == 8 and seq.output_token_ids == []

    second = step(sched)
    assert summary(second) == [("a", 8, 8, False)]
    assert second.scheduled[0].block_ids == [0, 1, 2, 3]

    third = schedule(sched)
    assert summary(third) == [("a", 16, 4, True)]  # the last chunk samples the first token
    assert third.num_batched_tokens == 4
    assert third.scheduled[0].block_ids == [0, 1, 2, 3, 4]
    assert apply(sched, third) == [SequenceUpdate(seq, model_token("a", 0))]

    fourth = step(sched)
    assert summary(fourth) == [("a", 20, 1, True)]
    assert fourth.scheduled[0].block_ids == [0, 1, 2, 3, 4, 5]  # token 20 opens block 5
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == expected_outputs("a", 2)
    assert_all_freed(sched)


def test_chunk_updates_report_no_token() -> None:
    sched = make_scheduler(budget=5)
    seq = make_sequence("a", 7)
    sched.add_sequence(seq)
    assert apply(sched, schedule(sched)) == [SequenceUpdate(seq, None)]


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    sched = make_scheduler(budget=8)
    sched.add_sequence(make_sequence("a", 3, max_tokens=10))
    assert summary(step(sched)) == [("a", 0, 3, True)]
    sched.add_sequence(make_sequence("b", 20, max_tokens=1))
    # Running sequences are served first, then the newcomer fills the rest of the budget.
    assert summary(step(sched)) == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert summary(step(sched)) == [("a", 4, 1, True), ("b", 7, 7, False)]
    output = step(sched)
    assert summary(output) == [("a", 5, 1, True), ("b", 14, 6, True)]
    assert output.num_batched_tokens == 7


def test_budget_exhausted_by_running_requests_admits_nobody() -> None:
    sched = make_scheduler(budget=2)
    for rid in "ab":
        sched.add_sequence(make_sequence(rid, 1, max_tokens=5))
    assert summary(step(sched)) == [("a", 0, 1, True), ("b", 0, 1, True)]
    sched.add_sequence(make_sequence("c", 1))
    assert summary(step(sched)) == [("a", 1, 1, True), ("b", 1, 1, True)]
    assert [r.seq_id for r in sched.waiting] == ["c"]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits_it_whole() -> None:
    sched = make_scheduler(budget=8, chunked=False, max_model_len=8)
    sched.add_sequence(make_sequence("a", 3, max_tokens=3))
    assert summary(step(sched)) == [("a", 0, 3, True)]
    sched.add_sequence(make_sequence("b", 8, max_tokens=1))
    assert summary(step(sched)) == [("a", 3, 1, True)]  # 1 + 8 > 8: b is not chunked
    assert summary(step(sched)) == [("a", 4, 1, True)]  # a finishes
    assert summary(step(sched)) == [("b", 0, 8, True)]


def run_bounded(sched: Scheduler, max_steps: int) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_sequences():
            return
        step(sched)


def test_without_chunked_prefill_a_budget_below_max_model_len_is_refused() -> None:
    # Without chunking, a prompt (or a preempted sequence's prompt + output) longer than the budget
    # could never be scheduled and, as the FCFS head, would block the queue forever.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_model_len \(32\)"):
        make_scheduler(budget=8, chunked=False, max_model_len=32)


def test_without_chunked_prefill_a_preempted_request_resumes() -> None:
    sched = make_scheduler(num_blocks=4, budget=16, chunked=False, caching=False, max_model_len=16)
    a = make_sequence("a", 6, max_tokens=4)
    b = make_sequence("b", 6, max_tokens=4)
    sched.add_sequence(a)
    sched.add_sequence(b)
    run_bounded(sched, 4)
    assert b.num_preemptions == 1
    run_bounded(sched, 100)
    assert not sched.has_unfinished_sequences()
    assert b.output_token_ids == expected_outputs("b", 4)
    assert a.output_token_ids == expected_outputs("a", 4)


# ------------------------------------------------------------------------------------- priorities
def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    specs = [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]
    for rid, priority in specs:
        sched.add_sequence(make_sequence(rid, 2, max_tokens=1, priority=priority))
    assert [r.seq_id for r in sched.waiting] == ["d", "b", "e", "a", "c"]
    order = [s[0][0] for s in run(sched)]
    assert order == ["d", "b", "e", "a", "c"]


def test_running_batch_is_served_in_priority_order() -> None:
    sched = make_scheduler()
    sched.add_sequence(make_sequence("low", 2, max_tokens=5, priority=1))
    assert summary(step(sched)) == [("low", 0, 2, True)]
    sched.add_sequence(make_sequence("high", 2, max_tokens=5, priority=0))
    assert summary(step(sched)) == [("low", 2, 1, True), ("high", 0, 2, True)]
    assert summary(step(sched)) == [("high", 2, 1, True), ("low", 3, 1, True)]


def test_priority_decides_who_gets_a_small_budget() -> None:
    sched = make_scheduler(budget=1)
    sched.add_sequence(make_sequence("late", 1, max_tokens=3, priority=2))
    sched.add_sequence(make_sequence("urgent", 1, max_tokens=3, priority=-3))
    steps = run(sched)
    assert [s[0][0] for s in steps] == ["urgent"] * 3 + ["late"] * 3


# ------------------------------------------------------------------------------------- preemption
def test_preemption_frees_the_worst_request_and_resumes_it_without_losing_tokens() -> None:
    sched = make_scheduler(num_blocks=4, caching=False)
    a = make_sequence("a", 6, max_tokens=4)
    b = make_sequence("b", 6, max_tokens=4)
    sched.add_sequence(a)
    sched.add_sequence(b)
    calls: list[tuple[str, int]] = []

    def model(seq: Sequence) -> int:
        calls.append((seq.seq_id, seq.num_output_tokens))
        return fake_model(seq)

    assert summary(step(sched, model)) == [("a", 0, 6, True), ("b", 0, 6, True)]
    assert sched.kv_cache.get_block_ids("b") == [2, 3]
    assert summary(step(sched, model)) == [("a", 6, 1, True), ("b", 6, 1, True)]
    assert summary(step(sched, model)) == [("a", 7, 1, True), ("b", 7, 1, True)]
    assert sched.kv_cache.num_free_blocks == 0

    # a's 9th token needs a third block: b (the later arrival) is preempted to make room.
    output = schedule(sched)
    assert summary(output) == [("a", 8, 1, True)]
    assert output.preempted == [b]
    assert b.status is SequenceStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert "b" not in sched.kv_cache.seq_to_blocks
    assert b.output_token_ids == expected_outputs("b", 3)  # kept across preemption
    assert sched.waiting == [b] and sched.running == [a]
    assert output.scheduled[0].block_ids == [0, 1, 3]  # b's tail block, freed last-first, went first
    apply(sched, output, model)
    assert a.status is SequenceStatus.FINISHED_LENGTH

    # b resumes: recomputes prompt + its 3 outputs in one chunk and samples output index 3.
    assert summary(step(sched, model)) == [("b", 0, 9, True)]
    assert b.status is SequenceStatus.FINISHED_LENGTH
    assert b.output_token_ids == expected_outputs("b", 4)
    assert sorted(c for c in calls if c[0] == "b") == [("b", i) for i in range(4)]  # each index once
    assert sched.num_preemptions_total == 1
    assert sched.stats().num_preemptions_total == 1
    assert_all_freed(sched)


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    sched = make_scheduler(num_blocks=4, caching=True)
    a = make_sequence("a", 6, max_tokens=4)
    b = make_sequence("b", 6, max_tokens=4)
    sched.add_sequence(a)
    sched.add_sequence(b)
    for _ in range(3):
        step(sched)
    output = step(sched)  # preempts b, whose 2 computed full blocks (tokens 0..7) were cached
    assert output.preempted == [b]
    # a took b's tail block (evicting its hash); b's first block is still cached and free.
    assert summary(step(sched)) == [("b", 4, 5, True)]
    assert b.num_cached_prompt_tokens == 0  # set at the first schedule only
    assert b.output_token_ids == expected_outputs("b", 4)
    assert_all_freed(sched)


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_worst() -> None:
    sched = make_scheduler(num_blocks=4, caching=False)
    a = make_sequence("a", 3, max_tokens=5)  # 1 block
    b = make_sequence("b", 12, max_tokens=3)  # 3 blocks; its first decode needs a 4th
    sched.add_sequence(a)
    sched.add_sequence(b)
    assert summary(step(sched)) == [("a", 0, 3, True), ("b", 0, 12, True)]
    output = step(sched)
    assert summary(output) == [("a", 3, 1, True)]
    assert output.preempted == [b]
    assert b.output_token_ids == expected_outputs("b", 1)
    steps = run(sched)
    # b needs 4 blocks to resume: it waits until a (1 to 2 blocks) is done.
    assert [s[0][0] for s in steps] == ["a", "a", "a", "b", "b"]
    assert steps[3] == [("b", 0, 13, True)]
    assert b.output_token_ids == expected_outputs("b", 3)
    assert a.output_token_ids == expected_outputs("a", 5)
    assert_all_freed(sched)


def test_preemption_victim_is_the_lowest_priority_not_the_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=4, caching=False)
    background = make_sequence("background", 3, max_tokens=5, priority=1)  # arrives first
    urgent = make_sequence("urgent", 12, max_tokens=3, priority=0)
    sched.add_sequence(background)
    sched.add_sequence(urgent)
    assert summary(step(sched)) == [("urgent", 0, 12, True), ("background", 0, 3, True)]
    output = step(sched)
    assert output.preempted == [background]
    assert summary(output) == [("urgent", 12, 1, True)]
    run(sched)
    assert background.output_token_ids == expected_outputs("background", 5)
    assert urgent.output_token_ids == expected_outputs("urgent", 3)


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=4, caching=False)
    sched.add_sequence(make_sequence("a", 3, max_tokens=5))
    sched.add_sequence(make_sequence("b", 12, max_tokens=3))
    step(sched)
    sched.add_sequence(make_sequence("vip", 1, max_tokens=1, priority=-1))  # fits in one block
    output = step(sched)
    assert [r.seq_id for r in output.preempted] == ["b"]
    assert summary(output) == [("a", 3, 1, True)]  # vip was not admitted despite free blocks
    assert summary(step(sched)) == [("a", 4, 1, True), ("vip", 0, 1, True)]


def test_preempted_request_keeps_its_arrival_order_in_the_waiting_queue() -> None:
    sched = make_scheduler(num_blocks=4, caching=False, max_num_seqs=2)
    a = make_sequence("a", 6, max_tokens=4)
    b = make_sequence("b", 6, max_tokens=4)
    c = make_sequence("c", 1, max_tokens=1)
    for seq in (a, b, c):
        sched.add_sequence(seq)
    for _ in range(4):
        step(sched)
    assert b.num_preemptions == 1
    # c arrived after b, so b (arrival 1) is ahead of c (arrival 2) although it was preempted later.
    assert [r.seq_id for r in sched.waiting] == ["b", "c"]
    assert b.arrival_seq == 1


# ------------------------------------------------------------------------------- stop conditions
def run_single(seq: Sequence, model: Model = fake_model, **sched_args: Any) -> Scheduler:
    sched = make_scheduler(**sched_args)
    sched.add_sequence(seq)
    run(sched, model)
    assert_all_freed(sched)
    return sched


def test_finish_on_eos() -> None:
    seq = make_sequence("a", 5, eos=[7, 8], max_tokens=10)
    run_single(seq, scripted_model({2: 8}))
    assert seq.output_token_ids == [*expected_outputs("a", 2), 8]
    assert seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.status.finish_reason == "stop"
    assert seq.stop_reason == 8


def test_finish_on_stop_token_id() -> None:
    seq = make_sequence("a", 5, stop_token_ids=(9,), max_tokens=10)
    run_single(seq, scripted_model({0: 3, 1: 9}))
    assert seq.output_token_ids == [3, 9]
    assert seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.stop_reason == 9


def test_ignore_eos_keeps_generating_but_honours_stop_token_ids() -> None:
    seq = make_sequence("a", 5, eos=[7], ignore_eos=True, max_tokens=4)
    run_single(seq, scripted_model({1: 7}))
    assert seq.output_token_ids == [model_token("a", 0), 7, *[model_token("a", i) for i in (2, 3)]]
    assert seq.status is SequenceStatus.FINISHED_LENGTH

    stopped = make_sequence("b", 5, eos=[7], ignore_eos=True, stop_token_ids=(7,), max_tokens=4)
    run_single(stopped, scripted_model({1: 7}))
    assert stopped.num_output_tokens == 2
    assert stopped.status is SequenceStatus.FINISHED_STOPPED


def test_finish_on_max_tokens() -> None:
    seq = make_sequence("a", 5, eos=[7], max_tokens=3)
    run_single(seq)
    assert seq.output_token_ids == expected_outputs("a", 3)
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.status.finish_reason == "length"
    assert seq.stop_reason is None


def test_stop_token_on_the_last_allowed_token_reports_stop() -> None:
    seq = make_sequence("a", 5, eos=[7], max_tokens=3)
    run_single(seq, scripted_model({2: 7}))
    assert seq.num_output_tokens == 3
    assert seq.status is SequenceStatus.FINISHED_STOPPED


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_finish_on_max_model_len(max_tokens: int | None) -> None:
    seq = make_sequence("a", 10, max_tokens=max_tokens)
    sched = run_single(seq, max_model_len=16)
    assert seq.num_tokens == 16 == sched.max_model_len
    assert seq.output_token_ids == expected_outputs("a", 6)
    assert seq.status is SequenceStatus.FINISHED_LENGTH


def test_prompt_one_short_of_max_model_len_gets_one_token() -> None:
    seq = make_sequence("a", 15, max_tokens=None)
    run_single(seq, max_model_len=16)
    assert seq.num_output_tokens == 1
    assert seq.status is SequenceStatus.FINISHED_LENGTH


def test_add_request_rejects_a_prompt_longer_than_max_model_len() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(AssertionError):
        sched.add_sequence(make_sequence("a", 17))
    with pytest.raises(AssertionError):
        sched.add_sequence(make_sequence("empty", []))
    sched.add_sequence(make_sequence("b", 3))
    with pytest.raises(AssertionError, match="duplicate"):
        sched.add_sequence(make_sequence("b", 3))


class ScriptedGrammar:
    """A grammar (sequence.GrammarState) that allows every token but `banned` and ends on `end`;
    counts the scheduler's calls to it, batched (one call for the step's rows) or one by one."""

    batch_calls: ClassVar[list[int]] = []  # rows per accept_tokens call, across instances

    def __init__(self, end: int, banned: int = -1) -> None:
        self.end, self.banned = end, banned
        self.taken: list[int] = []
        self.terminated = False

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.banned or self.terminated:
            return False
        self.taken.append(token_id)
        self.terminated = token_id == self.end
        return True

    @staticmethod
    def accept_tokens(grammars: list[ScriptedGrammar], token_ids: list[int]) -> list[bool]:
        ScriptedGrammar.batch_calls.append(len(grammars))
        return [grammar.accept_token(token) for grammar, token in zip(grammars, token_ids, strict=True)]

    def is_terminated(self) -> bool:
        return self.terminated

    def can_end(self) -> bool:
        return True


def test_a_steps_constrained_rows_take_their_tokens_in_one_grammar_call() -> None:
    ScriptedGrammar.batch_calls.clear()
    sched = make_scheduler()
    grammars = {
        "ends": ScriptedGrammar(end=7),
        "runs": ScriptedGrammar(end=-2),
        "refuses": ScriptedGrammar(end=-2, banned=9),
    }
    seqs = {}
    for name in ("free", "ends", "runs", "refuses"):
        seqs[name] = make_sequence(name, 5, eos=[7], ignore_eos=True, max_tokens=6)
        seqs[name].grammar = grammars.get(name)
        sched.add_sequence(seqs[name])
    run(sched, scripted_model({2: 7, 4: 9}))
    assert_all_freed(sched)
    assert seqs["free"].status is SequenceStatus.FINISHED_LENGTH
    assert seqs["runs"].status is SequenceStatus.FINISHED_LENGTH
    # a grammar that ended on EOS ends its sequence, whatever ignore_eos says
    assert seqs["ends"].status is SequenceStatus.FINISHED_STOPPED and seqs["ends"].stop_reason == 7
    assert grammars["ends"].taken == seqs["ends"].output_token_ids and len(grammars["ends"].taken) == 3
    # a token the grammar refuses (the sampler masks those: a bug) ends the sequence with an error
    assert seqs["refuses"].status is SequenceStatus.FINISHED_ERROR
    assert grammars["refuses"].taken == seqs["refuses"].output_token_ids[:4]
    # one call a step for the constrained rows still running
    assert ScriptedGrammar.batch_calls == [3, 3, 3, 2, 2, 1]


def test_only_sampling_rows_of_live_constrained_sequences_take_a_grammar_token() -> None:
    """A prefill chunk that samples nothing, and a sequence aborted between schedule() and the
    step's result, leave their grammars alone; the others take theirs in one call."""
    ScriptedGrammar.batch_calls.clear()
    sched = make_scheduler(budget=12)
    grammars = {name: ScriptedGrammar(end=-2) for name in ("short", "aborted", "chunked")}
    seqs = {}
    for name, prompt_len in (("short", 3), ("aborted", 3), ("chunked", 10)):
        seqs[name] = make_sequence(name, prompt_len, max_tokens=4)
        seqs[name].grammar = grammars[name]
        sched.add_sequence(seqs[name])
    output = schedule(sched)
    assert summary(output) == [("short", 0, 3, True), ("aborted", 0, 3, True), ("chunked", 0, 6, False)]
    sched.on_launched(output)
    sched.finish_sequences(["aborted"], SequenceStatus.FINISHED_ABORTED)
    apply(sched, output)
    assert ScriptedGrammar.batch_calls == [1]
    assert len(seqs["short"].output_token_ids) == 1
    assert grammars["short"].taken == seqs["short"].output_token_ids
    assert grammars["aborted"].taken == [] and grammars["chunked"].taken == []
    run(sched)
    assert grammars["chunked"].taken == seqs["chunked"].output_token_ids
    assert_all_freed(sched)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    always_eos = make_sequence("a", 5, eos=[7], min_tokens=3, max_tokens=10)
    run_single(always_eos, lambda seq: 7)
    # Indexes 0..2 are below min_tokens (the sampler would suppress EOS there): the first EOS that
    # counts is the 4th token.
    assert always_eos.output_token_ids == [7, 7, 7, 7]
    assert always_eos.status is SequenceStatus.FINISHED_STOPPED

    always_stop = make_sequence("b", 5, stop_token_ids=(9,), min_tokens=2, max_tokens=10)
    run_single(always_stop, lambda seq: 9)
    assert always_stop.output_token_ids == [9, 9, 9]
    assert always_stop.status is SequenceStatus.FINISHED_STOPPED


def test_finished_request_is_freed_and_forgotten_in_the_same_update() -> None:
    sched = make_scheduler()
    seq = make_sequence("a", 5, eos=[7], max_tokens=10)
    sched.add_sequence(seq)
    output = schedule(sched)
    assert sched.kv_cache.get_block_ids("a") == [0, 1]
    assert apply(sched, output, lambda r: 7) == [SequenceUpdate(seq, 7)]
    assert seq.is_finished
    assert_all_freed(sched)
    assert schedule(sched).is_empty


# ---------------------------------------------------------------------------------------- aborts
def test_abort_waiting_request() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_sequence("a", 5), make_sequence("b", 5)
    sched.add_sequence(a)
    sched.add_sequence(b)
    step(sched)
    assert sched.finish_sequences(["b"], SequenceStatus.FINISHED_ABORTED) == [b]
    assert b.status is SequenceStatus.FINISHED_ABORTED
    assert b.status.finish_reason == "abort"
    assert sched.waiting == [] and "b" not in sched.sequences
    sched.check_integrity()
    run(sched)
    assert b.output_token_ids == []
    assert_all_freed(sched)


def test_abort_running_request_frees_its_blocks() -> None:
    sched = make_scheduler(num_blocks=8)
    a, b = make_sequence("a", 10, max_tokens=20), make_sequence("b", 5)
    sched.add_sequence(a)
    sched.add_sequence(b)
    step(sched)
    assert sched.kv_cache.get_block_ids("a") == [0, 1, 2]
    assert sched.finish_sequences(["a"], SequenceStatus.FINISHED_ABORTED) == [a]
    assert a not in sched.running and "a" not in sched.sequences
    assert "a" not in sched.kv_cache.seq_to_blocks and "a" not in sched.kv_cache.num_cached_blocks
    assert sched.kv_cache.num_free_blocks == 8 - 2
    sched.check_integrity()
    assert [s[0][0] for s in run(sched)] == ["b"] * 3
    assert_all_freed(sched)


def test_abort_preempted_request() -> None:
    sched = make_scheduler(num_blocks=4, caching=False)
    sched.add_sequence(make_sequence("a", 3, max_tokens=5))
    b = make_sequence("b", 12, max_tokens=3)
    sched.add_sequence(b)
    step(sched)
    step(sched)
    assert b.status is SequenceStatus.PREEMPTED
    assert sched.finish_sequences(["b"], SequenceStatus.FINISHED_ABORTED) == [b]
    assert b.status is SequenceStatus.FINISHED_ABORTED and sched.waiting == []
    sched.check_integrity()
    run(sched)
    assert_all_freed(sched)


def test_abort_between_schedule_and_update_drops_the_step_result() -> None:
    sched = make_scheduler()
    a, b = make_sequence("a", 5, max_tokens=3), make_sequence("b", 5, max_tokens=3)
    sched.add_sequence(a)
    sched.add_sequence(b)
    step(sched)
    output = schedule(sched)
    sched.finish_sequences(["a"], SequenceStatus.FINISHED_ABORTED)
    updates = apply(sched, output)  # the model still returned a token for a
    assert updates == [SequenceUpdate(b, model_token("b", 1))]
    assert a.output_token_ids == expected_outputs("a", 1)
    assert a.num_computed_tokens == 5  # not advanced for a step that no longer counts
    run(sched)
    assert b.output_token_ids == expected_outputs("b", 3)
    assert_all_freed(sched)


def test_finish_requests_ignores_unknown_and_finished_ids() -> None:
    sched = make_scheduler()
    a = make_sequence("a", 3, max_tokens=1)
    sched.add_sequence(a)
    run(sched)
    assert sched.finish_sequences(["a", "nobody"], SequenceStatus.FINISHED_ABORTED) == []
    assert a.status is SequenceStatus.FINISHED_LENGTH  # an abort after the fact changes nothing
    with pytest.raises(AssertionError):
        sched.finish_sequences(["a"], SequenceStatus.RUNNING)


# ---------------------------------------------------------------------------------- prefix cache
def test_full_prefix_hit_still_schedules_the_last_token() -> None:
    sched = make_scheduler()
    prompt = prompt_tokens("shared", 9)
    first = make_sequence("first", prompt, max_tokens=1)
    sched.add_sequence(first)
    first_blocks = step(sched).scheduled[0].block_ids
    assert first.is_finished  # its two full blocks stay cached in the free queue

    second = make_sequence("second", prompt, max_tokens=1)
    sched.add_sequence(second)
    output = step(sched)
    assert summary(output) == [("second", 8, 1, True)]
    assert output.scheduled[0].block_ids[:2] == first_blocks[:2]
    assert second.num_cached_prompt_tokens == 8
    assert sched.stats().prefix_cache_hit_tokens == 8
    assert sched.stats().prefix_cache_queried_tokens == 9 + 9


def test_block_aligned_prompt_recomputes_its_last_block() -> None:
    sched = make_scheduler()
    prompt = prompt_tokens("shared", 8)
    sched.add_sequence(make_sequence("first", prompt, max_tokens=1))
    run(sched)
    sched.add_sequence(make_sequence("second", prompt, max_tokens=1))
    assert summary(step(sched)) == [("second", 4, 4, True)]


def test_prefix_shared_with_a_running_request() -> None:
    sched = make_scheduler(budget=64)
    prefix = prompt_tokens("sys", 8)
    a = make_sequence("a", [*prefix, 1, 2], max_tokens=3)
    sched.add_sequence(a)
    step(sched)
    b = make_sequence("b", [*prefix, 3], max_tokens=3)
    sched.add_sequence(b)
    output = step(sched)
    assert summary(output) == [("a", 10, 1, True), ("b", 8, 1, True)]
    a_blocks, b_blocks = (s.block_ids for s in output.scheduled)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] not in a_blocks
    assert [sched.kv_cache.pool.blocks[i].ref_count for i in a_blocks[:2]] == [2, 2]
    run(sched)
    assert b.output_token_ids == expected_outputs("b", 3)
    assert_all_freed(sched)


def test_stats_snapshot() -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add_sequence(make_sequence("a", 8))
    sched.add_sequence(make_sequence("b", 8))
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    # 8 computed tokens -> 2 of 10 blocks; the sampled 9th token gets its slot when it is scheduled.
    assert stats.kv_usage == pytest.approx(0.2)
    assert stats.prefix_cache_queried_tokens == 8 and stats.prefix_cache_hit_tokens == 0


# ------------------------------------------------------------------------- property-based workload
VOCAB = 24  # small, so EOS / stop ids are hit now and then and shared prefixes are common


@dataclass
class Spec:
    seq_id: str
    arrival_step: int
    prompt: list[int]
    max_tokens: int | None
    min_tokens: int
    priority: int
    eos: frozenset[int]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    abort_step: int | None
    abort_mid_step: bool  # abort between schedule() and update_from_output()


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_model_len: int
    budget: int
    max_num_seqs: int
    caching: bool
    chunked: bool
    specs: list[Spec]
    prefill_cap: int = 0  # max_prefill_tokens_while_decoding


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    # Mostly small pools, so that concurrent sequences run out of blocks and get preempted.
    block_size = draw(st.sampled_from([1, 2, 3, 4, 4, 4, 8]))
    num_blocks = draw(st.one_of(st.integers(8, 16), st.integers(8, 40)))
    # max_model_len fits in the pool, so a sequence alone always fits: anything else could livelock.
    max_model_len = draw(st.integers(2, min(num_blocks * block_size, 96)))
    chunked = draw(st.booleans())
    # Without chunked prefill a resumed sequence must be recomputed in one step: the budget has to
    # cover max_model_len, or the scheduler would (legitimately) wait forever.
    budget = draw(st.integers(1, 24)) if chunked else draw(st.integers(max_model_len, max_model_len + 8))
    shared = random.Random(draw(st.integers(0, 1 << 16))).choices(range(VOCAB), k=40)
    specs = []
    for index in range(draw(st.integers(1, 12))):
        prompt_len = draw(st.integers(1, min(80, max_model_len - 1)))
        prefix_len = draw(st.integers(0, prompt_len)) if draw(st.booleans()) else 0
        prefix_len = min(prefix_len, len(shared))
        suffix = random.Random(draw(st.integers(0, 1 << 16))).choices(range(VOCAB), k=prompt_len - prefix_len)
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 40)))
        abort = draw(st.one_of(st.none(), st.tuples(st.integers(0, 60), st.booleans())))
        specs.append(
            Spec(
                seq_id=f"r{index}",
                arrival_step=draw(st.integers(0, 20)),
                prompt=shared[:prefix_len] + suffix,
                max_tokens=max_tokens,
                min_tokens=draw(st.integers(0, min(max_tokens or 4, 4))),
                priority=draw(st.integers(-2, 2)),
                eos=frozenset(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
                stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=1))),
                ignore_eos=draw(st.booleans()),
                abort_step=None if abort is None else abort[0],
                abort_mid_step=False if abort is None else abort[1],
            )
        )
    return Workload(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        budget=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        caching=draw(st.booleans()),
        chunked=chunked,
        specs=specs,
        prefill_cap=draw(st.sampled_from([0, 0, 1, 3, 8])),
    )


def oracle(spec: Spec, max_model_len: int) -> tuple[list[int], SequenceStatus]:
    """What the sequence must produce without interference: the fake model's tokens up to the first
    stop condition (a stop token counts only at output index >= min_tokens, as the sampler suppresses
    it before; a stop beats a length limit)."""
    outputs: list[int] = []
    while True:
        token = model_token(spec.seq_id, len(outputs), VOCAB)
        outputs.append(token)
        if len(outputs) > spec.min_tokens and (
            (token in spec.eos and not spec.ignore_eos) or token in spec.stop_token_ids
        ):
            return outputs, SequenceStatus.FINISHED_STOPPED
        if spec.max_tokens is not None and len(outputs) >= spec.max_tokens:
            return outputs, SequenceStatus.FINISHED_LENGTH
        if len(spec.prompt) + len(outputs) >= max_model_len:
            return outputs, SequenceStatus.FINISHED_LENGTH


class ShadowKV:
    """The token each KV slot holds, written as the fake model would: a step that computes positions
    [start, start + n) of a sequence writes those tokens into its blocks. Every position a step relies
    on (< start) must hold the sequence's own token, whether it was computed or came from the cache."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # A slot holds a token, or (sequence, position) for a token still pending when it was
        # written (asynchronous scheduling: the device had its value, the host did not yet).
        self.slots: dict[tuple[int, int], int | tuple[Sequence, int]] = {}

    def _token(self, slot: tuple[int, int]) -> int | None:
        value = self.slots.get(slot)
        if isinstance(value, tuple):
            seq, pos = value
            value = seq.all_token_ids[pos]
            assert value != PENDING_TOKEN, f"{seq.seq_id}: KV of a token never resolved"
        return value

    def run_step(self, sched: Scheduler, output: SchedulerOutput) -> None:
        pool, size = sched.kv_cache.pool, self.block_size
        for scheduled in output.scheduled:
            tokens = scheduled.seq.all_token_ids
            table = scheduled.block_ids
            for pos in range(scheduled.num_computed_tokens):
                slot = (table[pos // size], pos % size)
                assert self._token(slot) == tokens[pos], f"{scheduled.seq_id} reads stale KV at {pos}"
            start = scheduled.num_computed_tokens
            for pos in range(start, start + scheduled.num_new_tokens):
                block_id = table[pos // size]
                # Writing into a block another sequence also reads would corrupt its KV.
                assert pool.blocks[block_id].ref_count == 1, f"write into shared block {block_id}"
                token = tokens[pos]
                self.slots[(block_id, pos % size)] = (scheduled.seq, pos) if token == PENDING_TOKEN else token


def check_step(
    sched: Scheduler, output: SchedulerOutput, running_before: list[Sequence], waiting_before: list[Sequence]
) -> None:
    """Per-step invariants of one schedule() result (before update_from_output)."""
    ids = [s.seq_id for s in output.scheduled]
    assert len(ids) == len(set(ids))
    assert len(output.scheduled) <= sched.config.max_num_seqs
    assert len(sched.running) <= sched.config.max_num_seqs
    for scheduled in output.scheduled:
        seq = scheduled.seq
        assert seq.status is SequenceStatus.RUNNING
        assert scheduled.num_new_tokens >= 1
        assert scheduled.num_computed_tokens == seq.num_computed_tokens  # not advanced yet
        end = scheduled.num_computed_tokens + scheduled.num_new_tokens
        assert end <= seq.num_tokens
        assert scheduled.needs_sample == (end == seq.num_tokens)
        assert scheduled.block_ids == sched.kv_cache.get_block_ids(seq.seq_id)
        assert len(scheduled.block_ids) >= sched.kv_cache.num_blocks_for_tokens(end)
    for victim in output.preempted:
        assert victim.status is SequenceStatus.PREEMPTED and victim.num_computed_tokens == 0
        assert victim in running_before and victim.seq_id not in ids
        assert victim.seq_id not in sched.kv_cache.seq_to_blocks
    # Previously running sequences come first: their decodes best first, then their prompt chunks
    # best first; admissions follow in waiting-queue order.
    decodes = [s.seq for s in output.scheduled if s.seq in running_before and _is_decode(s)]
    chunks = [s.seq for s in output.scheduled if s.seq in running_before and not _is_decode(s)]
    resumed = decodes + chunks
    admitted = [s.seq for s in output.scheduled if s.seq not in running_before]
    assert [s.seq for s in output.scheduled] == resumed + admitted
    assert [r.schedule_key for r in decodes] == sorted(r.schedule_key for r in decodes)
    assert [r.schedule_key for r in chunks] == sorted(r.schedule_key for r in chunks)
    assert admitted == waiting_before[: len(admitted)]
    if output.preempted and admitted:
        # Pool-shortage preemption stops admission; admissions next to preemptions only happen
        # when the admitted sequences outrank the victims (priority preemption).
        best_admitted = min(r.priority for r in admitted)
        assert all(v.priority > best_admitted for v in output.preempted), "admitted after preempting"
    if output.preempted:
        # A decode takes the worst sequence not yet scheduled, a prompt chunk the worst prompt: no
        # victim outranks a prompt that was served (decodes keep their blocks, whatever their rank).
        worst_chunk = max((r.schedule_key for r in chunks), default=None)
        assert worst_chunk is None or all(worst_chunk < v.schedule_key for v in output.preempted)


def _is_decode(scheduled: ScheduledSequence) -> bool:
    """The row computes a decoding sequence's one token (and its proposals)."""
    return scheduled.needs_sample and scheduled.num_new_tokens == 1 + len(scheduled.draft_token_ids)


MAX_STEPS = 20_000


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_random_workloads_keep_every_invariant(workload: Workload) -> None:
    run_workload(workload, pipelined=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_random_workloads_keep_every_invariant_with_asynchronous_scheduling(workload: Workload) -> None:
    """Step N+1 is scheduled and launched before step N's tokens are applied (pending tokens)."""
    run_workload(workload, pipelined=True)


def run_workload(workload: Workload, pipelined: bool) -> None:
    sched = make_scheduler(
        workload.num_blocks,
        max_num_seqs=workload.max_num_seqs,
        budget=workload.budget,
        caching=workload.caching,
        chunked=workload.chunked,
        max_model_len=workload.max_model_len,
        block_size=workload.block_size,
        prefill_cap=workload.prefill_cap,
    )
    kv = sched.kv_cache
    seqs = {
        spec.seq_id: make_sequence(
            spec.seq_id,
            spec.prompt,
            eos=sorted(spec.eos),
            max_tokens=spec.max_tokens,
            min_tokens=spec.min_tokens,
            priority=spec.priority,
            stop_token_ids=spec.stop_token_ids,
            ignore_eos=spec.ignore_eos,
        )
        for spec in workload.specs
    }
    specs = {spec.seq_id: spec for spec in workload.specs}
    sampled_indices: dict[str, list[int]] = {rid: [] for rid in seqs}
    aborted: set[str] = set()
    not_arrived = sorted(workload.specs, key=lambda spec: spec.arrival_step)
    shadow = ShadowKV(workload.block_size)

    def abort(step_index: int, mid_step: bool) -> None:
        for spec in workload.specs:
            if spec.abort_step == step_index and spec.abort_mid_step == mid_step:
                done = sched.finish_sequences([spec.seq_id], SequenceStatus.FINISHED_ABORTED)
                aborted.update(r.seq_id for r in done)
                sched.check_integrity()

    step_index = 0
    unapplied: tuple[SchedulerOutput, dict[str, int]] | None = None  # launched, not yet applied
    while not_arrived or sched.has_unfinished_sequences() or unapplied is not None:
        assert step_index < MAX_STEPS, "livelock: sequences never finish"
        while not_arrived and not_arrived[0].arrival_step <= step_index:
            sched.add_sequence(seqs[not_arrived.pop(0).seq_id])
        abort(step_index, mid_step=False)

        running_before, waiting_before = list(sched.running), list(sched.waiting)
        output = sched.schedule()
        sched.check_integrity()
        check_step(sched, output, running_before, waiting_before)
        if sched.has_unfinished_sequences() and unapplied is None:
            assert not output.is_empty, "a step with unfinished sequences scheduled nothing"
        shadow.run_step(sched, output)

        sampled = {}
        for scheduled in output.scheduled:
            if scheduled.needs_sample:
                index = scheduled.seq.num_output_tokens
                sampled_indices[scheduled.seq_id].append(index)
                sampled[scheduled.seq_id] = model_token(scheduled.seq_id, index, VOCAB)
        abort(step_index, mid_step=True)
        if pipelined:
            sched.on_launched(output)
            sched.check_integrity()
            if unapplied is not None:
                sched.update_from_output(*unapplied)
            unapplied = None if output.is_empty else (output, sampled)
        else:
            sched.update_from_output(output, sampled)
        sched.check_integrity()
        step_index += 1

    for rid, seq in seqs.items():
        expected, status = oracle(specs[rid], workload.max_model_len)
        assert seq.is_finished
        if rid in aborted:
            assert seq.status is SequenceStatus.FINISHED_ABORTED
            assert seq.output_token_ids == expected[: seq.num_output_tokens]
            # The model may have run once more for a step whose result the abort discarded (twice
            # with asynchronous scheduling: two steps can be in flight).
            num_extra = 2 if pipelined else 1
            assert sampled_indices[rid] in [
                list(range(seq.num_output_tokens + extra)) for extra in range(num_extra + 1)
            ]
        else:
            assert seq.output_token_ids == expected
            assert seq.status is status
            if pipelined and status is SequenceStatus.FINISHED_STOPPED:
                # The step after the stop token was launched before the stop was known.
                assert sampled_indices[rid] in (
                    list(range(len(expected))),
                    list(range(len(expected) + 1)),
                )
            else:
                assert sampled_indices[rid] == list(range(len(expected)))  # no index sampled twice
    assert sum(r.num_preemptions for r in seqs.values()) == sched.num_preemptions_total
    assert kv.num_free_blocks == kv.num_blocks
    assert sched.sequences == {} and sched.running == [] and sched.waiting == []
    assert kv.seq_to_blocks == {} and kv.num_cached_blocks == {}
    kv.check_integrity()


# ---------------------------------------------------------------------------- priority preemption
def test_a_waiting_request_that_outranks_a_running_one_preempts_it() -> None:
    sched = make_scheduler(max_num_seqs=1)
    low = make_sequence("low", 4, max_tokens=6, priority=5)
    sched.add_sequence(low)
    step(sched)
    step(sched)
    assert low.num_output_tokens == 2
    high = make_sequence("high", 3, max_tokens=2, priority=-1)
    sched.add_sequence(high)
    output = schedule(sched)
    assert output.preempted == [low] and low.status is SequenceStatus.PREEMPTED
    assert summary(output) == [("high", 0, 3, True)]
    apply(sched, output)
    run(sched)
    assert high.output_token_ids == expected_outputs("high", 2)
    assert low.output_token_ids == expected_outputs("low", 6)  # nothing lost or repeated
    assert low.num_preemptions == 1
    assert_all_freed(sched)


def test_equal_priority_never_preempts_for_admission() -> None:
    sched = make_scheduler(max_num_seqs=1)
    first = make_sequence("first", 4, max_tokens=3)
    sched.add_sequence(first)
    step(sched)
    sched.add_sequence(make_sequence("second", 4, max_tokens=3))
    output = schedule(sched)
    assert not output.preempted and summary(output) == [("first", 4, 1, True)]


# ------------------------------------------------------------------------ prefill share while decoding
def test_prefill_share_is_capped_only_while_something_decodes():
    sched = make_scheduler(budget=64, prefill_cap=6)
    sched.add_sequence(make_sequence("a", 10, max_tokens=8))
    assert summary(step(sched)) == [("a", 0, 10, True)], "nothing decodes yet: the whole budget"
    sched.add_sequence(make_sequence("b", 20, max_tokens=4))
    sched.add_sequence(make_sequence("c", 20, max_tokens=4))
    # a decodes: b gets the 6-token prefill share, c waits for the next step's.
    assert summary(step(sched)) == [("a", 10, 1, True), ("b", 0, 6, False)]
    assert summary(step(sched)) == [("a", 11, 1, True), ("b", 6, 6, False)]
    assert sched.waiting[0].seq_id == "c" and sched.check_integrity() is None


def test_without_a_cap_prefill_takes_the_whole_budget():
    sched = make_scheduler(budget=64)
    sched.add_sequence(make_sequence("a", 10, max_tokens=8))
    step(sched)
    sched.add_sequence(make_sequence("b", 20, max_tokens=4))
    assert summary(step(sched)) == [("a", 10, 1, True), ("b", 0, 20, True)]


# --------------------------------------------------------------------------------- decodes first
def test_decodes_go_first_while_an_outranking_prompt_is_computed_in_chunks():
    """vLLM's chunked-prefill policy: a long prompt computed in chunks, even one that outranks the
    decoding sequences, takes only the budget the decodes leave; no decode misses a step."""
    sched = make_scheduler(num_blocks=80, budget=32)
    for index in range(3):
        sched.add_sequence(make_sequence(f"d{index}", 4, max_tokens=20))
    step(sched)
    sched.add_sequence(make_sequence("urgent", 200, max_tokens=2, priority=-1))
    assert summary(step(sched)) == [
        ("d0", 4, 1, True),
        ("d1", 4, 1, True),
        ("d2", 4, 1, True),
        ("urgent", 0, 29, False),
    ]
    for computed in range(1, 5):
        assert summary(step(sched)) == [
            ("d0", 4 + computed, 1, True),
            ("d1", 4 + computed, 1, True),
            ("d2", 4 + computed, 1, True),
            ("urgent", 29 * computed, 29, False),
        ]


def test_a_prompt_chunk_short_of_blocks_gives_up_its_own_not_a_decodes():
    """The pool is short for an outranking prompt's next chunk: the prompt is preempted (its blocks
    freed, recomputed later), not the decode behind it, which keeps its blocks and its token."""
    sched = make_scheduler(num_blocks=5, budget=8)
    sched.add_sequence(make_sequence("d0", 4, max_tokens=10))
    step(sched)
    prompt = make_sequence("p", 16, max_tokens=1, priority=-1)
    sched.add_sequence(prompt)
    assert summary(step(sched)) == [("d0", 4, 1, True), ("p", 0, 7, False)]  # 2 blocks each
    output = step(sched)  # p's next 7 tokens need 2 more blocks; 1 is free
    assert summary(output) == [("d0", 5, 1, True)] and output.preempted == [prompt]
    run(sched)
    assert prompt.output_token_ids == expected_outputs("p", 1) and prompt.num_preemptions >= 1
    assert sched.sequences == {} and sched.kv_cache.num_free_blocks == 5
