"""Reading Prometheus text from Triton's /metrics endpoint in tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from paged_llm.testing.prometheus import parse, value

__all__ = ["parse", "settled_metrics", "value", "wait_for", "wait_idle"]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def wait_idle(server, timeout_s: float = 30.0) -> None:
    """Running/waiting gauges at 0 and every KV block back in the pool (metrics refresh every 0.5 s)."""

    def idle() -> bool:
        text = server.metrics()
        return (
            value(text, "paged_llm_num_requests_running") == 0
            and value(text, "paged_llm_num_requests_waiting") == 0
            and value(text, "paged_llm_kv_cache_usage_ratio") == 0.0
        )

    assert wait_for(idle, timeout_s=timeout_s), server.metrics()[-3000:]


def settled_metrics(server, names: tuple[str, ...], timeout_s: float = 20.0, interval_s: float = 0.6) -> str:
    """One scrape taken once `names` read the same in two scrapes a refresh apart: related counters
    compared from it are as of one engine snapshot (two scrapes may straddle a refresh)."""
    previous = [value(server.metrics(), name) for name in names]
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(interval_s)
        text = server.metrics()
        now = [value(text, name) for name in names]
        if now == previous or time.monotonic() > deadline:
            return text
        previous = now
