"""When the stub polls is_cancelled() next (triton_model/cancel_pacing.py; issue "Reliability and
security round 3", row 11: a cancellation noticed 2 s late after one slow poll)."""

from __future__ import annotations

import pytest

from paged_llm.triton_model.cancel_pacing import CancelPollPacing


def test_one_slow_poll_does_not_stop_polling_for_seconds():
    pacing = CancelPollPacing(min_interval_s=0.05, max_interval_s=0.25, duty=0.05)
    assert pacing.next_interval_s(0.0003, 1, 1) == 0.05
    # One round trip that took 0.1 s (the machine busy): the next poll still comes soon.
    assert pacing.next_interval_s(0.1, 1, 1) <= 0.05
    assert pacing.next_interval_s(0.0003, 1, 1) == 0.05


def test_the_first_poll_being_slow_is_bounded_too():
    pacing = CancelPollPacing(min_interval_s=0.05, max_interval_s=0.25, duty=0.05)
    assert pacing.next_interval_s(2.0, 1, 1) == 0.25


def test_many_streams_back_off_to_the_duty_cycle_within_the_bound():
    pacing = CancelPollPacing(min_interval_s=0.05, max_interval_s=0.25, duty=0.05)
    assert pacing.next_interval_s(100 * 0.0001, 100, 100) == pytest.approx(0.2)  # 10 ms polls: 5 %
    assert pacing.next_interval_s(1000 * 0.0001, 1000, 1000) == 0.25


def test_no_stream_open_polls_at_the_shortest_interval():
    pacing = CancelPollPacing(min_interval_s=0.05, max_interval_s=0.25, duty=0.05)
    assert pacing.next_interval_s(0.0, 0, 0) == 0.05
