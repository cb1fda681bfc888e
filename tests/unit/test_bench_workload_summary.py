from __future__ import annotations

import pytest

from paged_llm.testing.bench_workload import RequestRecord, format_summary, summarize


def test_longest_gap_is_each_streams_worst_wait_after_its_first_response() -> None:
    records = [
        RequestRecord(0, send_time=0.0, arrival_times=[0.1, 0.2, 0.7, 0.8], tokens_per_response=[1, 1, 1, 1]),
        RequestRecord(1, send_time=0.0, arrival_times=[0.3, 0.35, 0.4], tokens_per_response=[1, 1, 1]),
        RequestRecord(2, send_time=0.0, arrival_times=[0.2], tokens_per_response=[1]),  # no gap
        RequestRecord(3, send_time=0.0, error="boom"),
    ]
    summary = summarize(records)
    # The first stream's worst gap is 0.5 s (0.2 -> 0.7), the second's 0.05 s; the time to the first
    # response (0.3 s) is not a gap.
    assert summary["longest_gap_ms"]["max"] == pytest.approx(500.0)
    assert summary["longest_gap_ms"]["mean"] == pytest.approx(275.0)
    assert summary["itl_ms"]["max"] == pytest.approx(500.0)
    assert summary["ttft_ms"]["max"] == pytest.approx(300.0)
    assert summary["num_errors"] == 1
    assert "longest_gap p50/p90/p99/max" in format_summary("run", summary)


def test_no_streams_gives_empty_percentiles() -> None:
    summary = summarize([RequestRecord(0, send_time=0.0, error="refused")])
    assert summary["longest_gap_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    assert "longest_gap -" in format_summary("run", summary)
