"""Scheduler with speculative decoding: how many proposals a step verifies (budget, max_tokens,
max_model_len, a short pool), the slots they get (exact block ids), which proposals count as computed
(accepted ones only), what reaches the prefix cache, and stops inside an accepted run.

The fake verifier accepts proposals while they equal the fake model's tokens (what greedy
verification does) and then emits the model's token, so the outputs must be exactly the fake
model's whatever was proposed."""

from __future__ import annotations

from paged_llm.core.scheduler import Scheduler, SchedulerOutput
from tests.unit.test_scheduler import (
    assert_all_freed,
    expected_outputs,
    make_scheduler,
    make_sequence,
    model_token,
    schedule,
    summary,
)


def verify_and_apply(sched: Scheduler, output: SchedulerOutput) -> None:
    sampled: dict[str, int] = {}
    emitted: dict[str, list[int]] = {}
    for item in output.scheduled:
        seq = item.seq
        first = seq.num_output_tokens - seq.num_pending_tokens  # index of the step's first new token
        if item.draft_token_ids:
            tokens = []
            for offset, draft in enumerate(item.draft_token_ids):
                target = model_token(seq.seq_id, first + offset)
                tokens.append(target)
                if draft != target:
                    break
            else:
                tokens.append(model_token(seq.seq_id, first + len(item.draft_token_ids)))
            emitted[seq.seq_id] = tokens
        elif item.needs_sample:
            sampled[seq.seq_id] = model_token(seq.seq_id, first)
    if not output.launched:
        sched.on_launched(output)
    sched.update_from_output(output, sampled, emitted)
    sched.check_integrity()


def propose(sched: Scheduler, right: int, wrong: int = 0) -> None:
    """Every decoding sequence proposes `right` correct tokens then `wrong` wrong ones."""
    for seq in sched.running:
        if seq.num_tokens - seq.num_computed_tokens == 1:
            first = seq.num_output_tokens
            good = [model_token(seq.seq_id, first + i) for i in range(right)]
            seq.spec_token_ids = good + [1] * wrong


def test_proposals_get_slots_and_only_the_accepted_ones_count_as_computed():
    sched = make_scheduler(num_blocks=16)
    sched.add_sequence(make_sequence("a", 6, max_tokens=20))
    verify_and_apply(sched, schedule(sched))  # prefill 6, sample output 0
    seq = sched.sequences["a"]
    assert (seq.num_tokens, seq.num_computed_tokens) == (7, 6)
    propose(sched, right=2, wrong=2)
    output = schedule(sched)
    # The last token (position 6) and 4 proposals (positions 7..10): blocks 0, 1, 2 (4 tokens each).
    assert summary(output) == [("a", 6, 5, True)]
    assert output.scheduled[0].draft_token_ids[:2] == expected_outputs("a", 3)[1:]
    assert sched.kv_cache.get_block_ids("a") == [0, 1, 2]
    sched.on_launched(output)  # in flight: only the last token counts as computed
    assert (seq.num_tokens, seq.num_computed_tokens) == (8, 7)
    verify_and_apply(sched, output)
    # 2 accepted + 1 emitted: 10 tokens, KV valid up to position 8 (the last token plus 2 accepted).
    assert (seq.num_tokens, seq.num_computed_tokens) == (10, 9)
    assert seq.output_token_ids == expected_outputs("a", 4)
    # Only the block of computed positions 0..3 and 4..7 is full and computed: cached; block 2 not.
    assert sched.kv_cache.num_cached_blocks["a"] == 2
    assert (sched.spec_num_drafts, sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens) == (1, 4, 2)


def test_the_step_verifies_no_more_than_the_budget_and_the_length_limits_allow():
    sched = make_scheduler(num_blocks=32, budget=8)
    sched.add_sequence(make_sequence("a", 3, max_tokens=4))
    sched.add_sequence(make_sequence("b", 3, max_tokens=50))
    verify_and_apply(sched, schedule(sched))
    propose(sched, right=10)
    output = schedule(sched)
    # a: 1 output, max_tokens 4 -> at most 3 more tokens -> 2 proposals; b: the budget's remaining 5.
    assert summary(output) == [("a", 3, 3, True), ("b", 3, 5, True)]
    verify_and_apply(sched, output)
    assert sched.sequences["b"].output_token_ids == expected_outputs("b", 6)
    assert "a" not in sched.sequences  # 1 + 2 accepted + 1 = 4 = max_tokens: finished
    while sched.has_unfinished_sequences():
        propose(sched, right=3, wrong=1)
        verify_and_apply(sched, schedule(sched))
    assert_all_freed(sched)


def test_max_model_len_bounds_the_proposals():
    sched = make_scheduler(num_blocks=32, max_model_len=10)
    sched.add_sequence(make_sequence("a", 6, max_tokens=None))
    verify_and_apply(sched, schedule(sched))  # 7 tokens
    propose(sched, right=8)
    output = schedule(sched)
    assert summary(output) == [("a", 6, 3, True)]  # 10 - 7 - 1 = 2 proposals
    verify_and_apply(sched, output)
    assert "a" not in sched.sequences and sched.kv_cache.usage == 0.0


def test_a_stop_token_inside_the_accepted_run_ends_the_sequence_there():
    stop = model_token("a", 2)
    sched = make_scheduler(num_blocks=16)
    sched.add_sequence(make_sequence("a", 5, max_tokens=30, stop_token_ids=(stop,)))
    verify_and_apply(sched, schedule(sched))
    seq = sched.sequences["a"]
    propose(sched, right=4)
    verify_and_apply(sched, schedule(sched))
    assert seq.output_token_ids == expected_outputs("a", 3)  # the stop token is the last
    assert seq.is_finished and seq.stop_reason == stop
    assert_all_freed(sched)


def test_a_short_pool_drops_the_proposals_before_it_preempts():
    # 3 blocks of 4: "a" takes 2 (6 prompt tokens), "b" the third (2 prompt tokens); a's decode at
    # position 6 fits its second block, but proposals at 7..10 would need a fourth block.
    sched = make_scheduler(num_blocks=3, max_model_len=12)
    sched.add_sequence(make_sequence("a", 6, max_tokens=5))
    sched.add_sequence(make_sequence("b", 2, max_tokens=2))
    verify_and_apply(sched, schedule(sched))
    propose(sched, right=4)
    output = schedule(sched)
    assert summary(output) == [("a", 6, 1, True), ("b", 2, 1, True)] and not output.preempted
    assert [item.draft_token_ids for item in output.scheduled] == [[], []]
