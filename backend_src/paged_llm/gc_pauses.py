"""This process's garbage-collection pauses, counted through `gc.callbacks`.

A full collection stops every thread of the process: in the engine core that is a step that
comes late for every stream. `process_gc_pauses()` installs one recorder per process (however
many engines it builds) and returns its running totals; the core publishes them with its stats
(`paged_llm_engine_gc_*` metrics) and the benchmarks print them next to the latencies.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass

LONG_PAUSE_S = 0.005  # a pause at least this long is counted as long (more than a decode step)


@dataclass(frozen=True)
class GcPauses:
    """Totals since the recorder was installed."""

    num_collections: int = 0
    pause_s_total: float = 0.0
    num_long_pauses: int = 0  # pauses >= LONG_PAUSE_S
    longest_pause_s: float = 0.0

    def since(self, earlier: GcPauses) -> GcPauses:
        """What happened after `earlier` (the longest pause is the longest since installation)."""
        return GcPauses(
            self.num_collections - earlier.num_collections,
            self.pause_s_total - earlier.pause_s_total,
            self.num_long_pauses - earlier.num_long_pauses,
            self.longest_pause_s,
        )


class _Recorder:
    def __init__(self) -> None:
        self.totals = GcPauses()
        self._started_at = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        # Runs inside the collector, with the GIL held: keep it tiny.
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        pause_s = time.perf_counter() - self._started_at
        totals = self.totals
        self.totals = GcPauses(
            totals.num_collections + 1,
            totals.pause_s_total + pause_s,
            totals.num_long_pauses + (pause_s >= LONG_PAUSE_S),
            max(totals.longest_pause_s, pause_s),
        )


_recorder: _Recorder | None = None
_install_lock = threading.Lock()


def process_gc_pauses() -> GcPauses:
    """This process's pauses since the first call (which installs the recorder)."""
    global _recorder
    if _recorder is None:
        with _install_lock:
            if _recorder is None:
                _recorder = _Recorder()
                gc.callbacks.append(_recorder)
    return _recorder.totals
