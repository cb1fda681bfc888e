"""Histograms exported as Prometheus histograms (Triton's histogram metric family), and their bucket
helpers.

Triton renders a `MetricFamily.HISTOGRAM` as one `# TYPE <name> histogram` family: its
`<name>_bucket{le=...}` series cumulative and in bucket order ending with `le="+Inf"`, then
`<name>_sum` and `<name>_count`, which is what `histogram_quantile()` and vllm_backend's tests read.
Every `observe()` is a round trip to the server process, so the observations of a metrics update are
buffered here (`observe_many`) and sent together by the thread doing the update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def buckets_1_2_5(upper: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... while <= upper."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > upper:
                return buckets
            buckets.append(value)
        exponent += 1


class Histogram:
    """One labelled series of a Triton histogram family (the family is kept alive with it)."""

    def __init__(
        self, pb_utils: Any, name: str, description: str, buckets: list[float], labels: dict
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: histogram buckets must be strictly increasing, got {buckets}")
        family = pb_utils.MetricFamily(
            name=name, description=description, kind=pb_utils.MetricFamily.HISTOGRAM
        )
        self.families = [family]  # must outlive its metric (the backend checks)
        self.bounds = bounds  # Triton adds +Inf
        self._metric = family.Metric(labels=labels, buckets=bounds)

    def observe_many(self, values: Iterable[float]) -> None:
        for value in values:
            self._metric.observe(float(value))
