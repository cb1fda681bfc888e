"""The OpenAI server's own Prometheus metrics (Triton's stay on its metrics port)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PREFIX = "paged_llm_openai"


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS_S) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(_LATENCY_BUCKETS_S, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "total": self.total, "count": self.count}

    def add(self, other: dict) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other["counts"], strict=True)]
        self.total += other["total"]
        self.count += other["count"]

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*_LATENCY_BUCKETS_S, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            sep = "," if labels else ""
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}')
        brace = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{brace} {self.total:.6f}")
        out.append(f"{name}_count{brace} {self.count}")
        return out


class OpenAIMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.in_flight = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.durations: dict[str, _Histogram] = defaultdict(_Histogram)
        self.time_to_first_token: dict[str, _Histogram] = defaultdict(_Histogram)

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, route: str, status: int, duration_s: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[(route, status)] += 1
            self.durations[route].observe(duration_s)

    def first_token(self, route: str, seconds: float) -> None:
        with self._lock:
            self.time_to_first_token[route].observe(seconds)

    def tokens(self, num_prompt_tokens: int, num_completion_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
            self.completion_tokens += num_completion_tokens

    def to_dict(self) -> dict:
        """This process's figures, for a sibling worker's /metrics (see merged_text)."""
        with self._lock:
            return {
                "requests": [[route, status, count] for (route, status), count in self.requests.items()],
                "in_flight": self.in_flight,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "durations": {r: h.to_dict() for r, h in self.durations.items()},
                "time_to_first_token": {r: h.to_dict() for r, h in self.time_to_first_token.items()},
            }

    def render(self, others: list[dict] | None = None) -> str:
        """Prometheus text of this process's figures plus `others` (the other workers' to_dict())."""
        return merged_text([self.to_dict(), *(others or [])])


def merged_text(states: list[dict]) -> str:
    """Prometheus text of the sum of several processes' figures."""
    requests: dict[tuple[str, int], int] = defaultdict(int)
    durations: dict[str, _Histogram] = defaultdict(_Histogram)
    first_token: dict[str, _Histogram] = defaultdict(_Histogram)
    in_flight = prompt_tokens = completion_tokens = 0
    for state in states:
        for route, status, count in state["requests"]:
            requests[(route, int(status))] += count
        in_flight += state["in_flight"]
        prompt_tokens += state["prompt_tokens"]
        completion_tokens += state["completion_tokens"]
        for target, key in ((durations, "durations"), (first_token, "time_to_first_token")):
            for route, histogram in state[key].items():
                target[route].add(histogram)
    lines = [
        f"# HELP {_PREFIX}_requests_total Requests answered, by route and HTTP status.",
        f"# TYPE {_PREFIX}_requests_total counter",
    ]
    for (route, status), count in sorted(requests.items()):
        lines.append(f'{_PREFIX}_requests_total{{route="{route}",status="{status}"}} {count}')
    lines += [
        f"# HELP {_PREFIX}_requests_in_flight Generation requests being served now.",
        f"# TYPE {_PREFIX}_requests_in_flight gauge",
        f"{_PREFIX}_requests_in_flight {in_flight}",
        f"# HELP {_PREFIX}_prompt_tokens_total Prompt tokens of finished requests.",
        f"# TYPE {_PREFIX}_prompt_tokens_total counter",
        f"{_PREFIX}_prompt_tokens_total {prompt_tokens}",
        f"# HELP {_PREFIX}_generation_tokens_total Generated tokens sent to clients.",
        f"# TYPE {_PREFIX}_generation_tokens_total counter",
        f"{_PREFIX}_generation_tokens_total {completion_tokens}",
        f"# HELP {_PREFIX}_request_duration_seconds Time from request to last byte, by route.",
        f"# TYPE {_PREFIX}_request_duration_seconds histogram",
    ]
    for route, histogram in sorted(durations.items()):
        lines += histogram.lines(f"{_PREFIX}_request_duration_seconds", f'route="{route}"')
    lines += [
        f"# HELP {_PREFIX}_time_to_first_token_seconds Time from request to its first token.",
        f"# TYPE {_PREFIX}_time_to_first_token_seconds histogram",
    ]
    for route, histogram in sorted(first_token.items()):
        lines += histogram.lines(f"{_PREFIX}_time_to_first_token_seconds", f'route="{route}"')
    return "\n".join(lines) + "\n"
