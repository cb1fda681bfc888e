"""The engine core's structured output figures on their way to /metrics: the output processor hands
them to EngineStats, which keeps totals across a core restart and queues the compile times for the
histogram; TritonMetrics reports them from the stub that owns the core only.

pb_utils is replaced by a recorder here (unit level); tests/e2e/test_metrics.py reads the real
/metrics of a tritonserver."""

from __future__ import annotations

from typing import Any

from paged_llm.core.scheduler import SchedulerStats
from paged_llm.engine import stats as stats_module
from paged_llm.engine.core_types import EngineCoreOutputs, StructuredOutputStats
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.stats import EngineStats
from paged_llm.triton_model.metrics import TritonMetrics


def _core_stats(
    compiles: int = 2, seconds: tuple[float, ...] = (0.004, 1.5), **kinds: int
) -> StructuredOutputStats:
    return StructuredOutputStats(
        requests_by_kind=kinds or {"json": 2, "regex": 1},
        num_compiles=compiles,
        num_compile_errors=1,
        num_compile_timeouts=1,
        num_cache_hits=3,
        num_length_in_grammar=1,
        num_mask_fills=10,
        mask_fill_seconds=0.25,
        mask_wait_seconds=0.125,
        compile_seconds=list(seconds),
    )


def test_the_output_processor_hands_the_cores_figures_to_the_stats():
    stats = EngineStats()
    processor = OutputProcessor(tokenizer=None, stats=stats)
    processor.process(EngineCoreOutputs(scheduler_stats=SchedulerStats(0, 0, 0.0, 0, 0, 0)))
    assert stats.snapshot().structured_output == StructuredOutputStats()  # no constrained request yet
    processor.process(EngineCoreOutputs(structured_output_stats=_core_stats()))
    snapshot = stats.snapshot()
    assert snapshot.structured_output.requests_by_kind == {"json": 2, "regex": 1}
    assert snapshot.structured_output.num_cache_hits == 3
    assert snapshot.structured_output.compile_seconds == []  # observations, not totals
    assert stats.drain_observations().grammar_compile_s == [0.004, 1.5]
    # The next report's compile times only: each compile is observed once.
    processor.process(EngineCoreOutputs(structured_output_stats=_core_stats(compiles=3, seconds=(0.2,))))
    assert stats.drain_observations().grammar_compile_s == [0.2]
    assert stats.snapshot().structured_output.num_compiles == 3


def test_totals_carry_over_a_core_restart_and_compile_times_respect_the_cap(monkeypatch):
    monkeypatch.setattr(stats_module, "MAX_PENDING_OBSERVATIONS", 3)
    stats = EngineStats()
    stats.update_structured_output(_core_stats(seconds=(0.01, 0.02)))
    stats.on_core_lost(counted_its_totals=True)
    down = stats.snapshot().structured_output
    assert down.num_compiles == 2 and down.requests_by_kind == {"json": 2, "regex": 1}
    stats.on_core_up(owns_core=True)
    # the restarted core counts from 0 again
    stats.update_structured_output(_core_stats(compiles=1, seconds=(0.03, 0.04), json=1, choice=4))
    up = stats.snapshot().structured_output
    assert up.requests_by_kind == {"json": 3, "regex": 1, "choice": 4}
    assert (up.num_compiles, up.num_compile_errors, up.num_compile_timeouts) == (3, 2, 2)
    assert (up.num_cache_hits, up.num_length_in_grammar) == (6, 2)
    assert (up.num_mask_fills, up.mask_fill_seconds, up.mask_wait_seconds) == (20, 0.5, 0.25)
    assert stats.drain_observations().grammar_compile_s == [0.01, 0.02, 0.03]
    assert stats.snapshot().num_observations_dropped == 1


def test_a_stub_that_did_not_report_the_lost_core_keeps_no_base_of_its_structured_output_totals():
    stats = EngineStats()
    stats.update_structured_output(_core_stats())
    stats.on_core_lost(counted_its_totals=False)
    assert stats.snapshot().structured_output == StructuredOutputStats()


class _Metric:
    def __init__(self, kind: str, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.kind, self.labels, self.buckets = kind, labels, buckets
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, delta: float) -> None:
        self.value += delta

    def observe(self, value: float) -> None:
        self.observed.append(value)


class _PbUtils:
    """Stands in for pb_utils: records the metric families made and what their metrics were sent."""

    def __init__(self) -> None:
        made: dict[str, list[_Metric]] = {}
        self.made = made

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name: str, description: str, kind: str) -> None:
                self.kind = kind
                self.metrics = made.setdefault(name, [])

            def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> _Metric:
                self.metrics.append(_Metric(self.kind, labels, buckets))
                return self.metrics[-1]

        self.MetricFamily = MetricFamily

    def series(self, name: str, **labels: str) -> _Metric:
        [metric] = [m for m in self.made[name] if labels.items() <= m.labels.items()]
        return metric


def _metrics(stats: EngineStats, pb_utils: Any) -> TritonMetrics:
    return TritonMetrics(pb_utils, stats, "llm", "1")


def test_the_owner_stub_exports_the_counters_and_the_compile_time_histogram():
    pb_utils, stats = _PbUtils(), EngineStats()
    metrics = _metrics(stats, pb_utils)
    try:
        stats.update_structured_output(_core_stats())
        metrics.update()
        assert metrics._histograms.settle(timeout_s=10)
    finally:
        metrics.stop()
    kinds = {
        kind: pb_utils.series("paged_llm_structured_output_requests_total", kind=kind).value
        for kind in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
    }
    assert kinds == {"json": 2, "json_object": 0, "regex": 1, "choice": 0, "grammar": 0, "structural_tag": 0}
    counters = {
        name: pb_utils.series(name).value
        for name in (
            "paged_llm_grammar_compiles_total",
            "paged_llm_grammar_cache_hits_total",
            "paged_llm_grammar_compile_errors_total",
            "paged_llm_grammar_compile_timeouts_total",
            "paged_llm_structured_output_length_in_grammar_total",
            "paged_llm_grammar_mask_fills_total",
            "paged_llm_grammar_mask_fill_seconds_total",
            "paged_llm_grammar_mask_wait_seconds_total",
        )
    }
    assert list(counters.values()) == [2, 3, 1, 1, 1, 10, 0.25, 0.125]
    histogram = pb_utils.series("paged_llm_grammar_compile_seconds", model="llm", version="1")
    assert histogram.kind == "histogram" and histogram.observed == [0.004, 1.5]
    assert histogram.buckets[0] <= 0.001 and histogram.buckets[-1] >= 30.0


def test_a_stub_sharing_another_stubs_core_leaves_the_counters_to_that_one():
    pb_utils, stats = _PbUtils(), EngineStats()
    stats.on_core_up(owns_core=False)
    metrics = _metrics(stats, pb_utils)
    try:
        stats.update_structured_output(_core_stats())  # (the core sends them to its owner only)
        metrics.update()
    finally:
        metrics.stop()
    assert pb_utils.series("paged_llm_grammar_compiles_total").value == 0
    assert pb_utils.series("paged_llm_structured_output_requests_total", kind="json").value == 0
