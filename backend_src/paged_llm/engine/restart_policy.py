"""When the stub restarts a dead engine core, and when it gives up (engine/async_llm.py).

Every failure (a core that died, or a restart that did not come up) is counted; while at most
`max_restarts` failures fall within the last `window_s`, the core is started again after a backoff
that doubles with each failure in the window (base_delay_s, 2x, 4x, ... up to max_delay_s). One
more failure within the window and the stub gives up: it then exits non-zero so
that the launcher stops the server (a crash loop is a supervisor's problem, not a silent outage).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_restarts: int = 3
    window_s: float = 300.0
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    _failures: deque[float] = field(default_factory=deque)  # monotonic times within the window

    def on_failure(self, now: float) -> float | None:
        """Counts a failure at `now`; the delay before the next start, or None to give up."""
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.window_s:
            self._failures.popleft()
        count = len(self._failures)
        if count > self.max_restarts:
            return None
        return min(self.base_delay_s * 2 ** (count - 1), self.max_delay_s)

    @property
    def failures_in_window(self) -> int:
        return len(self._failures)


# The Triton stub's exit status once it gave up on its engine core (model.py): the launcher sees a
# dead stub under a model Triton still calls ready, stops the server and exits non-zero.
GAVE_UP_EXIT_STATUS = 70
