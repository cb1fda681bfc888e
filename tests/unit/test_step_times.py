"""The engine core's step periods (engine/step_times.py): what counts as a step's time and its kind."""

from __future__ import annotations

import pytest

from paged_llm.core.scheduler import ScheduledSequence, SchedulerOutput
from paged_llm.engine.step_times import StepClock, StepTimes


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def step(*rows: tuple[int, int]) -> SchedulerOutput:
    """rows: (new tokens, proposals) per scheduled sequence."""
    scheduled = [
        ScheduledSequence(None, 0, num_new_tokens, [], True, list(range(num_drafts)))  # type: ignore[arg-type]
        for num_new_tokens, num_drafts in rows
    ]
    return SchedulerOutput(scheduled, sum(n for n, _ in rows))


def test_a_period_runs_from_the_previous_finished_step_and_a_wait_breaks_the_chain():
    clock = FakeClock()
    steps = StepClock(clock)
    steps.on_step_finished(step((1, 0)))  # the first: no step before it
    assert steps.totals == StepTimes()
    clock.now_s += 0.004
    steps.on_step_finished(step((1, 0), (1, 0)))
    clock.now_s += 0.006
    steps.on_step_finished(step((1, 0)))
    assert steps.totals.num_decode_steps == 2
    assert steps.totals.decode_seconds == pytest.approx(0.010)
    steps.on_idle()  # the loop may have blocked for work: the next period would include the wait
    clock.now_s += 5.0
    steps.on_step_finished(step((1, 0)))
    clock.now_s += 0.003
    steps.on_step_finished(step((1, 0)))
    assert steps.totals.num_decode_steps == 3
    assert steps.totals.decode_seconds == pytest.approx(0.013)
    assert steps.totals.num_prefill_steps == 0


def test_a_step_with_a_prompt_chunk_is_a_prefill_step_and_proposals_are_still_decode():
    clock = FakeClock()
    steps = StepClock(clock)
    steps.on_step_finished(step((1, 0)))
    clock.now_s += 0.020
    steps.on_step_finished(step((1, 0), (512, 0)))  # one row prefills: the whole step waits for it
    clock.now_s += 0.005
    steps.on_step_finished(step((4, 3), (1, 0)))  # a token and three proposals verified
    clock.now_s += 0.007
    steps.on_step_finished(step((3, 1)))  # more than a token and its proposal: a chunk
    assert steps.totals == StepTimes(1, pytest.approx(0.005), 2, pytest.approx(0.027))
    assert steps.totals.count_and_seconds("prefill") == (2, pytest.approx(0.027))


def test_totals_add_up():
    assert StepTimes(1, 0.5, 2, 1.0).plus(StepTimes(3, 0.25, 0, 0.0)) == StepTimes(4, 0.75, 2, 1.0)
    with pytest.raises(ValueError, match="step kind"):
        StepTimes().count_and_seconds("spec")
