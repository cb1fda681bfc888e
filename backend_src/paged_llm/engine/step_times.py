"""How long the engine core's steps take while it is busy, counted in the core and exported as
`paged_llm_engine_steps_total{kind}` / `paged_llm_engine_step_seconds_total{kind}`.

A step's time is its *period*: from the end of the previous finished step to the end of this one,
counted only when the core went straight from one to the other (no idle wait in between). With the
pipelined loop that is the interval between two streamed tokens of a running sequence, the
launch, the device work, the grammar fills and the publishing of the step before all included: the
figure a TPOT is made of, measured where no client, stub or transport adds to it.

kind `decode`: every row of the step computed one token (with its speculative proposals, if any);
kind `prefill`: some row computed more (a prompt, a chunk of one, a preempted sequence's recompute).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from paged_llm.core.scheduler import SchedulerOutput

KINDS = ("decode", "prefill")


@dataclass(frozen=True)
class StepTimes:
    """Totals since the core started."""

    num_decode_steps: int = 0
    decode_seconds: float = 0.0
    num_prefill_steps: int = 0
    prefill_seconds: float = 0.0

    def plus(self, other: StepTimes) -> StepTimes:
        return StepTimes(
            self.num_decode_steps + other.num_decode_steps,
            self.decode_seconds + other.decode_seconds,
            self.num_prefill_steps + other.num_prefill_steps,
            self.prefill_seconds + other.prefill_seconds,
        )

    def count_and_seconds(self, kind: str) -> tuple[int, float]:
        if kind == "decode":
            return self.num_decode_steps, self.decode_seconds
        if kind == "prefill":
            return self.num_prefill_steps, self.prefill_seconds
        raise ValueError(f"unknown step kind {kind!r}")


def computes_prompt_tokens(scheduler_output: SchedulerOutput) -> bool:
    """Some row computes more tokens than a decode row does (its token and proposals)."""
    scheduled = scheduler_output.scheduled
    if scheduler_output.num_batched_tokens == len(scheduled):  # one token a row: no per-row look
        return False
    return any(s.num_new_tokens > 1 + len(s.draft_token_ids) for s in scheduled)


class StepClock:
    """Counts step periods; the core calls `on_step_finished` after each step whose tokens it took
    and `on_idle` wherever it may have waited for work since."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._last_end_s: float | None = None
        self.totals = StepTimes()

    def on_idle(self) -> None:
        self._last_end_s = None

    def on_step_finished(self, scheduler_output: SchedulerOutput) -> None:
        now = self._clock()
        last, self._last_end_s = self._last_end_s, now
        if last is None:
            return  # the first step after a wait: its period would include the wait
        period_s = now - last
        prefill = computes_prompt_tokens(scheduler_output)
        kind = StepTimes(0, 0.0, 1, period_s) if prefill else StepTimes(1, period_s)
        self.totals = self.totals.plus(kind)
