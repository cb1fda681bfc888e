"""TritonMetrics.before_final: the counters always; the histograms only for a stub's last request in
flight, at most `final_histogram_wait_s` (0: never). pb_utils is a recorder (unit level)."""

from __future__ import annotations

from paged_llm.engine.stats import EngineStats
from paged_llm.triton_model.metrics import TritonMetrics
from tests.unit.test_structured_output_metrics import _PbUtils

TTFT = "paged_llm_time_to_first_token_seconds"


def _first_token_observed(wait_s: float, wait_for_histograms: bool) -> tuple[int, list[float]]:
    pb_utils, stats = _PbUtils(), EngineStats()
    metrics = TritonMetrics(pb_utils, stats, "llm", "1", final_histogram_wait_s=wait_s)
    timeouts: list[float] = []
    settle = metrics._histograms.settle

    def recorded_settle(*args, timeout_s: float = 0.05, **kwargs) -> bool:
        timeouts.append(timeout_s)
        return settle(*args, timeout_s=timeout_s, **kwargs)

    metrics._histograms.settle = recorded_settle
    try:
        stats.on_token(0.25, None, now=1.0)
        metrics.before_final(wait_for_histograms=wait_for_histograms)
        generated = pb_utils.series("paged_llm_generation_tokens_total").value
        assert generated == 1, "the counters go before every final"
        return len(pb_utils.series(TTFT).observed) if timeouts else -1, timeouts
    finally:
        metrics.stop()


def test_the_last_final_in_flight_waits_for_the_histograms_at_most_the_set_time():
    observed, timeouts = _first_token_observed(10.0, wait_for_histograms=True)
    assert observed == 1 and timeouts == [10.0]


def test_no_wait_with_other_streams_open_or_with_the_wait_set_to_zero():
    assert _first_token_observed(10.0, wait_for_histograms=False)[1] == []
    assert _first_token_observed(0.0, wait_for_histograms=True)[1] == []
