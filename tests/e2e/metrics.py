"""Reading Prometheus text from Triton's /metrics endpoint in tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from paged_llm.testing.prometheus import parse, value

__all__ = ["parse", "value", "wait_for", "wait_idle"]


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
