"""GPU tests: an engine a test leaves to the garbage collector is collected before the next test
starts. Its CUDA graphs and KV pool would otherwise still be alive (engines hold reference
cycles) while the next engine captures graphs, which has made a capture fail with "operation not
permitted when stream is capturing", and their memory would count against the next KV budget."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def collect_engines_after_each_test() -> Iterator[None]:
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
