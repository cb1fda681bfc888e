"""The thread that sends histogram observations to the server.

Every `observe()` of the Python backend is a synchronous round trip to tritonserver (25-45 us, on the
channel that also carries the responses), and the per-token histograms take one per generated token.
Made on the path of the final responses they halved served throughput at 64 streams, so they are
made here instead, on a thread of their own that releases the GIL while it waits:

* it drains `EngineStats`' buffered observations continuously (every `idle_poll_s` when idle), so
  under light load little is pending when a request finishes;
* `settle()` (called before the FINAL response of a stub's last request in flight) waits until every
  observation recorded so far has gone out, but only when that is little work: at most `max_pending`
  observations, and no more than the wait allows at what an observation costs now (the cheapest of
  the last 8 batches; 0.2-0.8 ms on a loaded GPU host): a wait that cannot finish in time is not
  started, since it would only hold the final back. /metrics read right after a client's last
  response then counts its requests, and under load no final response waits for the histograms,
  which catch up a moment later.

The histograms' `Metric` objects are touched by this thread only (a pb_utils Metric is not
thread-safe).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from paged_llm.engine.stats import LatencyObservations

# (histogram, the LatencyObservations field it observes)
HistogramSources = Sequence[tuple[Any, str]]


class HistogramWriter:
    def __init__(
        self,
        drain: Callable[[], LatencyObservations],
        num_pending: Callable[[], int],
        histograms: HistogramSources,
        idle_poll_s: float = 0.01,
    ) -> None:
        self._drain = drain
        self._num_pending = num_pending
        self._histograms = list(histograms)
        self._idle_poll_s = idle_poll_s
        self._wake = threading.Event()
        self._stopping = False
        self._progress = threading.Condition()
        self._num_drains_started = 0
        self._num_drains_done = 0
        self._num_in_flight = 0  # observations drained and not yet all sent
        # the time an observation took in each of the last batches: the cheapest is what one costs
        # now (one batch slowed by a pause must not keep every later wait from starting)
        self._recent_seconds_per_observation: collections.deque[float] = collections.deque(maxlen=8)
        self._thread = threading.Thread(target=self._run, name="paged_llm-histograms", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Sends what is pending, then ends the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def settle(self, max_pending: int = 512, timeout_s: float = 0.05) -> bool:
        """Waits (at most `timeout_s`) until what was recorded before this call is sent, if that is at
        most `max_pending` observations that can go out within `timeout_s` (see the module docstring);
        True if it was."""
        if not self._thread.is_alive():
            return False
        with self._progress:
            if not self.can_send_unsent_within(timeout_s, max_pending):
                return False
            # a drain that starts after this point sees everything recorded before it
            wanted = self._num_drains_started + 1
        self._wake.set()
        with self._progress:
            return self._progress.wait_for(lambda: self._num_drains_done >= wanted, timeout=timeout_s)

    def can_send_unsent_within(self, timeout_s: float, max_pending: int = 512) -> bool:
        """Whether what is unsent now is at most `max_pending` observations that go out within
        `timeout_s` at the cheapest time per observation of the last 8 batches."""
        with self._progress:  # re-entrant (a Condition's default lock): settle() calls it holding it
            num_unsent = self._num_in_flight + self._num_pending()
            seconds_per_observation = min(self._recent_seconds_per_observation, default=0.0)
            return num_unsent <= max_pending and num_unsent * seconds_per_observation <= timeout_s

    def _run(self) -> None:
        while True:
            stopping = self._stopping
            with self._progress:
                self._num_drains_started += 1
                drain_number = self._num_drains_started
                observations = self._drain()
                self._num_in_flight = sum(len(values) for values in vars(observations).values())
            num_sent = self._num_in_flight
            start = time.monotonic()
            for histogram, field_name in self._histograms:
                histogram.observe_many(getattr(observations, field_name))
            elapsed = time.monotonic() - start
            with self._progress:
                if num_sent:
                    self._recent_seconds_per_observation.append(elapsed / num_sent)
                self._num_in_flight = 0
                self._num_drains_done = drain_number
                self._progress.notify_all()
            if stopping:
                return
            if not num_sent:
                self._wake.wait(self._idle_poll_s)
                self._wake.clear()
