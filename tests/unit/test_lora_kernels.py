"""The LoRA Triton kernels (lora/kernels.py) against the slots' PyTorch path, on CPU through the
Triton interpreter (with a GPU the same tests run the compiled kernels): random steps of base and
adapter rows in any order, decode-like (a row a sequence) and prefill-like (runs of rows), launched
with the grid of the step's own token count or of a larger graph bucket, across the 2048-token
line where tiles grow from 16 to 64 rows. Base rows must come out untouched, bit for bit."""

from __future__ import annotations

import os
from dataclasses import fields

import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from paged_llm.lora.kernels import LaunchShape, StepTileTensors, lora_update, partial_rows_needed
from paged_llm.lora.slots import NO_ADAPTER
from paged_llm.lora.step_tiles import StepTiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def expected(x, out, a, b, token_slots):
    """The update row by row, in float64."""
    result = out.double().clone()
    row = 0
    for slot, count in token_slots:
        if slot != NO_ADAPTER:
            rows = slice(row, row + count)
            result[rows] += (x[rows].double() @ a[slot].double().T) @ b[slot].double().T
        row += count
    return result


def run_kernels(token_slots, num_slots, in_features, out_features, width, dtype, padded_tokens=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(count for _, count in token_slots)
    padded = padded_tokens or num_tokens
    x = torch.randn(padded, in_features, generator=generator).to(dtype)
    out = torch.randn(padded, out_features, generator=generator).to(dtype)
    a = (torch.randn(num_slots, width, in_features, generator=generator) / in_features**0.5).to(dtype)
    b = torch.randn(num_slots, out_features, width, generator=generator).to(dtype)
    max_tokens = max(padded, 16)
    tiles = StepTiles(max_tokens, num_slots, torch.device("cpu"), pin_memory=False)
    tiles.set(token_slots)
    on_device = (getattr(tiles.tensors, f.name).to(DEVICE) for f in fields(StepTileTensors))
    device_tiles = StepTileTensors(*on_device)
    partial_size = partial_rows_needed(max_tokens, num_slots) * width
    partial = torch.empty(partial_size, dtype=torch.float32, device=DEVICE)
    got = out.to(DEVICE).clone()
    shape = LaunchShape.of(padded, num_slots)
    lora_update(x.to(DEVICE), got, a.to(DEVICE), b.to(DEVICE), device_tiles, partial, shape)
    want = expected(x[:num_tokens], out[:num_tokens], a, b, token_slots)
    return got.cpu(), want, out


def check(got, want, out, token_slots, dtype):
    num_tokens = want.shape[0]
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    scale = want.abs().max().item() + 1
    assert (got[:num_tokens].double() - want).abs().max().item() <= tolerance * scale
    row = 0
    for slot, count in token_slots:  # base rows untouched, bit for bit
        if slot == NO_ADAPTER:
            assert torch.equal(got[row : row + count], out[row : row + count])
        row += count
    assert torch.equal(got[num_tokens:], out[num_tokens:])  # padding rows too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_several_slots_interleaved_with_base_rows(dtype):
    token_slots = [(i % 5 - 1, 1) for i in range(37)]  # slots -1 (base), 0..3, in turn
    got, want, out = run_kernels(token_slots, 4, 96, 80, 24, dtype)
    check(got, want, out, token_slots, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_wider_than_a_kernel_block_go_in_pieces(dtype):
    """qkv at rank 96: 288 columns, past the 64 (float32) / 128 (bf16) a kernel block takes."""
    token_slots = [(0, 3), (NO_ADAPTER, 1), (1, 18)]
    got, want, out = run_kernels(token_slots, 2, 64, 40, 288, dtype)
    check(got, want, out, token_slots, dtype)


def test_prefill_runs_longer_than_a_tile_and_a_graph_bucket_larger_than_the_step():
    token_slots = [(2, 40), (NO_ADAPTER, 7), (0, 3), (2, 1), (1, 33)]
    got, want, out = run_kernels(token_slots, 3, 64, 48, 16, torch.float32, padded_tokens=128)
    check(got, want, out, token_slots, torch.float32)


def test_steps_either_side_of_the_tile_size_line():
    # 2100 tokens: 64-row tiles; the same rows padded to a bucket above the line, and a step of
    # 2000 tokens (16-row tiles) launched with a bucket's grid past 2048 (64-row BLOCK_M)
    for token_slots, padded in (
        ([(0, 1500), (NO_ADAPTER, 100), (1, 500)], None),
        ([(1, 1000), (0, 1000)], 2304),
    ):
        got, want, out = run_kernels(token_slots, 2, 16, 16, 16, torch.float32, padded_tokens=padded)
        check(got, want, out, token_slots, torch.float32)


def test_a_step_without_adapter_rows_changes_nothing():
    token_slots = [(NO_ADAPTER, 5), (NO_ADAPTER, 1)]
    got, _, out = run_kernels(token_slots, 2, 32, 32, 16, torch.float32, padded_tokens=16)
    assert torch.equal(got, out)


def test_tiles_of_a_smaller_step_leave_no_stale_tiles_behind():
    tiles = StepTiles(64, 2, torch.device("cpu"), pin_memory=False)
    tiles.set([(0, 40), (1, 20)])
    assert tiles.num_tiles == 3 + 2
    tiles.set([(1, 2)])
    ends = tiles.tensors.tile_end
    assert tiles.num_tiles == 1 and ends[0].item() == 2 and not ends[1:].any()
    assert tiles.tensors.tile_start[:1].tolist() == [0] and tiles.tensors.rows[:2].tolist() == [0, 1]


def test_partial_buffer_covers_every_step_shape():
    for max_tokens in (1, 16, 300, 4096, 16384):
        needed = partial_rows_needed(max_tokens, 8)
        for num_tokens in range(1, max_tokens + 1, 7):
            assert LaunchShape.of(num_tokens, 8).split(1 << 20) * num_tokens <= needed


try:  # (the GPU hosts' test libraries have no hypothesis)
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:
    pass
else:

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.lists(st.tuples(st.integers(NO_ADAPTER, 3), st.integers(1, 20)), min_size=1, max_size=12),
        st.sampled_from([16, 40, 72]),
        st.integers(0, 40),
    )
    def test_any_step(token_slots, in_features, padding):
        num_tokens = sum(count for _, count in token_slots)
        got, want, out = run_kernels(token_slots, 4, in_features, 24, 8, torch.float32, num_tokens + padding)
        check(got, want, out, token_slots, torch.float32)
