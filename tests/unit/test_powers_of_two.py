"""Plain-int powers of two for kernel launch parameters equal Triton's (they replace its host calls)."""

from __future__ import annotations

import pytest

from paged_llm.layers.powers_of_two import next_power_of_2, prev_power_of_2


def test_next_power_of_2_equals_tritons():
    triton = pytest.importorskip("triton")
    values = [*range(0, 4200), 65535, 65536, 65537, 151936, 1 << 20, (1 << 20) + 1]
    assert [next_power_of_2(v) for v in values] == [triton.next_power_of_2(v) for v in values]


def test_prev_power_of_2():
    values = (0, 1, 2, 3, 4, 5, 15, 16, 17, 1000)
    assert [prev_power_of_2(v) for v in values] == [0, 1, 2, 2, 4, 4, 8, 16, 16, 512]
