"""Reading Prometheus text (Triton's /metrics) in tests, benchmarks and the soak test."""

from __future__ import annotations

import re

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfaN]+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """{(metric name, its labels): value} of every sample line (comments and blank lines skipped)."""
    samples = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match:
            name, labels, number = match.groups()
            samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(number)
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there is none): a counter
    of every stub instance and model added up."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def value(text: str, name: str, **labels: str) -> float:
    """`total` over the samples of `text`."""
    return total(parse(text), name, **labels)
