"""Histograms kept in the backend and exported as Prometheus counter series, and their bucket helpers.

Every metric operation of the Python backend is a round trip to the server process, so a histogram is
accumulated here and `flush()` exports it in Prometheus' histogram layout as counter series:
`<name>_bucket{le=...}` (cumulative), `<name>_sum` and `<name>_count`. `histogram_quantile()` works on
them, at a cost per update of one call per bucket that changed, not one per observation.
"""

from __future__ import annotations

import bisect
import math
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


class CounterHistogram:
    """A Prometheus histogram accumulated here; `flush()` exports what was observed since the last
    flush as increments of cumulative `_bucket{le}`, `_sum` and `_count` counter series."""

    def __init__(
        self, pb_utils: Any, name: str, description: str, buckets: list[float], labels: dict
    ) -> None:
        counter = pb_utils.MetricFamily.COUNTER
        self.families = [
            pb_utils.MetricFamily(
                name=f"{name}_bucket", description=f"{description} (cumulative buckets)", kind=counter
            ),
            pb_utils.MetricFamily(name=f"{name}_sum", description=f"{description} (sum)", kind=counter),
            pb_utils.MetricFamily(name=f"{name}_count", description=f"{description} (count)", kind=counter),
        ]
        self.bounds = [float(b) for b in buckets] + [math.inf]
        self._buckets = [
            self.families[0].Metric(labels={**labels, "le": _format_bound(b)}) for b in self.bounds
        ]
        self._sum = self.families[1].Metric(labels=labels)
        self._count = self.families[2].Metric(labels=labels)
        self._pending = [0] * len(self.bounds)  # per bucket, not cumulative
        self._pending_sum = 0.0

    def observe_many(self, values: list[float]) -> None:
        for value in values:
            self._pending[bisect.bisect_left(self.bounds, value)] += 1
            self._pending_sum += value

    def flush(self) -> None:
        cumulative = 0
        for metric, count in zip(self._buckets, self._pending):
            cumulative += count
            if cumulative:
                metric.increment(cumulative)
        if cumulative:
            self._sum.increment(self._pending_sum)
            self._count.increment(cumulative)
        self._pending = [0] * len(self.bounds)
        self._pending_sum = 0.0


def _format_bound(bound: float) -> str:
    if math.isinf(bound):
        return "+Inf"
    return str(int(bound)) if bound == int(bound) else repr(bound)
