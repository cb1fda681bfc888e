"""TensorParallelGroup outside a process group: one rank needs no collective, and the one-shot
all-reduce is only set up where torch's kernel applies (CUDA, 2+ ranks, bfloat16 / float32).
Its numbers are checked on the lent GPUs (tests/gpu/test_tensor_parallel_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.parallel import TensorParallelGroup


def test_one_rank_returns_the_tensor_itself():
    group = TensorParallelGroup()
    tensor = torch.arange(6.0)
    assert group.all_reduce(tensor) is tensor
    assert not group.enable_one_shot(torch.device("cuda"), torch.bfloat16)
    assert not group.uses_one_shot


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.float16), ("meta", torch.bfloat16)],
)
def test_one_shot_is_not_set_up_where_it_does_not_apply(device, dtype):
    """No process group exists here: returning False must come before any collective."""
    group = TensorParallelGroup(rank=0, world_size=2)
    assert not group.enable_one_shot(torch.device(device), dtype)
    assert not group.uses_one_shot
