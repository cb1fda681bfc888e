"""The histogram writer: observations leave on its own thread; settle() before a final response waits
for them only when that is little work."""

from __future__ import annotations

import threading
import time

from paged_llm.engine import stats as stats_module
from paged_llm.engine.stats import EngineStats
from paged_llm.triton_model.histogram_writer import HistogramWriter


class RecordingHistogram:
    """Stands in for a pb_utils histogram Metric: records what it is sent; can be held shut."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()

    def observe_many(self, values: list[float]) -> None:
        values = list(values)
        if values:
            self.entered.set()
            self.open.wait(timeout=30)
        self.values.extend(values)


def _writer(stats: EngineStats, histogram: RecordingHistogram, field: str) -> HistogramWriter:
    return HistogramWriter(stats.drain_observations, stats.num_pending_observations, [(histogram, field)])


def test_settle_returns_once_everything_recorded_before_it_is_sent() -> None:
    stats = EngineStats()
    itl = RecordingHistogram()
    writer = _writer(stats, itl, "inter_token_latency_s")
    writer.start()
    try:
        for step in range(40):
            stats.on_token(None, last_token_time=float(step), now=float(step) + 0.5)
        assert writer.settle(max_pending=512, timeout_s=10)
        assert itl.values == [0.5] * 40
        # the next request's values too: settle always waits for a drain that started after it
        stats.on_token(None, last_token_time=1.0, now=1.25)
        assert writer.settle(max_pending=512, timeout_s=10)
        assert itl.values[-1] == 0.25 and len(itl.values) == 41
    finally:
        writer.stop()


def test_settle_does_not_wait_when_much_is_pending() -> None:
    stats = EngineStats()
    itl = RecordingHistogram()
    itl.open.clear()  # the server is slow: the writer is stuck in its first batch
    writer = _writer(stats, itl, "inter_token_latency_s")
    writer.start()
    try:
        stats.on_token(None, last_token_time=0.0, now=1.0)
        assert itl.entered.wait(timeout=10)
        for _ in range(600):
            stats.on_token(None, last_token_time=0.0, now=1.0)
        # 600 pending > 512: a final response would not wait for them
        assert writer.settle(max_pending=512, timeout_s=30) is False
        itl.open.set()
        assert writer.settle(max_pending=10_000, timeout_s=10)
        assert len(itl.values) == 601
    finally:
        writer.stop()


class SlowHistogram(RecordingHistogram):
    """Each observation takes at least 2 ms (a round trip to a loaded server)."""

    def observe_many(self, values: list[float]) -> None:
        values = list(values)
        super().observe_many(values)
        time.sleep(0.002 * len(values))


def test_settle_does_not_start_a_wait_that_cannot_finish_in_time() -> None:
    """A settle that would time out anyway is not started: it would only hold the final back."""
    stats = EngineStats()
    itl = SlowHistogram()
    writer = _writer(stats, itl, "inter_token_latency_s")
    writer.start()
    try:
        itl.open.clear()  # no batch completes until the estimate below is checked
        for _ in range(40):
            stats.on_token(None, last_token_time=0.0, now=1.0)
        assert writer.can_send_unsent_within(0.001)  # nothing measured yet: no estimate against it
        itl.open.set()
        assert writer.settle(max_pending=512, timeout_s=10)  # measures >= 2 ms per observation
        itl.open.clear()
        itl.entered.clear()
        stats.on_token(None, last_token_time=0.0, now=1.0)
        assert itl.entered.wait(timeout=10)  # the writer holds one, stuck in the server
        for _ in range(40):
            stats.on_token(None, last_token_time=0.0, now=1.0)
        # 41 unsent at >= 2 ms each (every batch so far took at least that per observation)
        assert not writer.can_send_unsent_within(0.05)
        assert writer.settle(max_pending=512, timeout_s=0.05) is False
        assert writer.can_send_unsent_within(10.0)
        assert not writer.can_send_unsent_within(10.0, max_pending=40)
        itl.open.set()
        assert writer.settle(max_pending=512, timeout_s=10)
        assert len(itl.values) == 81
    finally:
        writer.stop()


def test_one_slow_batch_does_not_keep_later_waits_from_starting() -> None:
    """A pause in one batch (a GC, a busy server for a moment) is not what an observation costs."""
    stats = EngineStats()
    itl = RecordingHistogram()
    writer = _writer(stats, itl, "inter_token_latency_s")
    writer.start()
    try:
        itl.open.clear()
        stats.on_token(None, last_token_time=0.0, now=1.0)
        assert itl.entered.wait(timeout=10)
        time.sleep(0.3)  # the first batch, one observation, takes >= 0.3 s
        itl.open.set()
        assert writer.settle(max_pending=512, timeout_s=10)
        for _ in range(4):  # fast batches after it
            stats.on_token(None, last_token_time=0.0, now=1.0)
            assert writer.settle(max_pending=512, timeout_s=10)
        for _ in range(20):
            stats.on_token(None, last_token_time=0.0, now=1.0)
        assert writer.can_send_unsent_within(0.05)
    finally:
        writer.stop()


def test_stop_sends_what_is_pending_and_settle_after_stop_returns_at_once() -> None:
    stats = EngineStats()
    e2e = RecordingHistogram()
    writer = _writer(stats, e2e, "e2e_latency_s")
    writer.start()
    stats.on_request_finished("stop", e2e_latency_s=2.0)
    writer.stop()
    assert e2e.values == [2.0]
    assert writer.settle() is False


def test_observations_past_the_cap_are_dropped_and_counted(monkeypatch) -> None:
    monkeypatch.setattr(stats_module, "MAX_PENDING_OBSERVATIONS", 3)
    stats = EngineStats()
    for _ in range(5):
        stats.on_token(None, last_token_time=0.0, now=1.0)
    assert stats.num_pending_observations() == 3
    assert stats.snapshot().num_observations_dropped == 2
    assert stats.snapshot().num_generation_tokens_total == 5  # the counters miss nothing
