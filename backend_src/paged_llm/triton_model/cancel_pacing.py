"""How often the stub asks Triton whether the clients of its open requests cancelled.

Each `is_cancelled()` is a round trip to the server process (0.1-0.4 ms on the GPU hosts), so at
hundreds of streams polling backs off to stay under a share (`duty`) of its thread's time. It backs
off on what a round trip costs with nothing in its way (the cheapest per check of the last few
polls; under steady load all of them are dear) times the streams open now, never on one poll's
wall time: on a loaded machine one poll can take 0.1 s (the thread, or the server's thread that
answers it, not scheduled, as on a 2-core machine while a server starts), and backing off 20x on
that one sample left a cancelled request unnoticed for 2 s (vllm_backend's
request_cancellation_test gives it 1 s). Never longer than `max_interval_s` either, whatever the load.
"""

from __future__ import annotations

from collections import deque

MIN_INTERVAL_S = 0.05  # each in-flight request is asked at most this often
MAX_INTERVAL_S = 0.25  # and at least this often
DUTY = 0.05  # polling may take about this share of its thread's time
_SAMPLES = 8


class CancelPollPacing:
    def __init__(
        self,
        min_interval_s: float = MIN_INTERVAL_S,
        max_interval_s: float = MAX_INTERVAL_S,
        duty: float = DUTY,
    ) -> None:
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.duty = duty
        self._per_check_s: deque[float] = deque(maxlen=_SAMPLES)

    def next_interval_s(self, poll_s: float, num_checks: int, num_open: int) -> float:
        """Seconds until the next poll, after one that made `num_checks` round trips in `poll_s`;
        `num_open`: the requests the next poll will ask about."""
        if num_checks:
            self._per_check_s.append(poll_s / num_checks)
        per_check_s = min(self._per_check_s, default=0.0)
        backed_off_s = per_check_s * num_open / self.duty
        return min(self.max_interval_s, max(self.min_interval_s, backed_off_s))
