"""Triton kernels for a step's LoRA updates: `out[t] += (x[t] @ A[s]^T) @ B[s]^T` for every row t
whose sequence runs adapter slot s, every slot of the step in one launch per half:

    shrink   partial[split, p, :W] = x[rows[p], k-range of split] @ A[slot]^T     (fp32)
    expand   out[rows[p], :] += (sum over splits of partial[:, p, :]) @ B[slot]^T

The rows of adapter rows are listed grouped by slot (`rows`, positions p), and cut into tiles of at
most BLOCK_M positions of one slot (`tile_slot`, `tile_start`, `tile_end`): a decode step's rows
are gathered this way (punica's BGMV), a prefill chunk's rows are consecutive runs (SGMV), and one
kernel serves both. Base rows belong to no tile and are left alone.

The launch shape depends only on the step's padded token count (`LaunchShape.of`): the grid has
room for every tile the rows can make, and unused tiles (start == end) return at once. So a CUDA
graph captured for a bucket replays any step of that bucket after the host rewrites the tile
arrays (lora/step_tiles.py). Decode steps have few rows per slot, so the shrink splits K over up to
MAX_SPLIT programs a tile, each writing its own partial sums (no atomics, nothing to zero); the
expand adds the splits while loading them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Enough programs to cover the SMs of a Hopper card about twice (132 SMs).
TARGET_PROGRAMS = 256
MAX_SPLIT = 16
BLOCK_K = 64
BLOCK_N = 128
MAX_BLOCK_W_BYTES = 256  # a B row's piece: 128 columns of bf16, 64 of float32
SMALL_STEP_TOKENS = 2048  # up to here (every graph bucket) tiles are 16 rows, above it 64
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class LaunchShape:
    """The grid of a step of `num_tokens` (padded) tokens with `num_slots` slots."""

    block_m: int
    num_tiles: int

    @staticmethod
    def of(num_tokens: int, num_slots: int) -> LaunchShape:
        """`num_tokens`: the step's tokens padded to its graph bucket (its own count eagerly). The
        grid has room for the tiles of any step of at most that many rows (`tile_rows`)."""
        block_m = tile_rows(num_tokens)
        most_tiles = max(triton.cdiv(min(num_tokens, SMALL_STEP_TOKENS), 16), triton.cdiv(num_tokens, 64))
        # every slot's last tile may be partial: one more tile per slot than the rows fill
        return LaunchShape(block_m, most_tiles + num_slots)

    def split(self, in_features: int) -> int:
        """Programs a tile's shrink is split over along K (each gets whole BLOCK_K chunks)."""
        return max(1, min(MAX_SPLIT, TARGET_PROGRAMS // self.num_tiles, triton.cdiv(in_features, BLOCK_K)))


def tile_rows(num_tokens: int) -> int:
    """Rows a tile of a step of `num_tokens` tokens holds at most (the host cuts its tiles by the
    step's real count, the kernel's BLOCK_M follows the padded one; the kernels loop over a tile in
    BLOCK_M pieces, so either may be the larger)."""
    return 16 if num_tokens <= SMALL_STEP_TOKENS else 64


def partial_rows_needed(max_num_tokens: int, num_slots: int) -> int:
    """Rows (splits x padded tokens) of the fp32 partial-sum buffer for any step up to max_num_tokens:
    only steps of a few tiles split, so this is max_num_tokens or a little over 4k."""
    short = range(1, min(max_num_tokens, 2 * SMALL_STEP_TOKENS) + 1)
    return max(max_num_tokens, *(LaunchShape.of(t, num_slots).split(1 << 30) * t for t in short))


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    partial_ptr,
    rows_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    in_features,
    width,
    k_per_split,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_p_split,
    stride_p_row,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:
        return
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_mask = w < width
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    for m0 in range(start, end, BLOCK_M):
        positions = m0 + tl.arange(0, BLOCK_M)
        position_mask = positions < end
        rows = tl.load(rows_ptr + positions, mask=position_mask, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + k[None, :],
                mask=position_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                a_ptr + slot * stride_a_slot + w[None, :] * stride_a_row + k[:, None],
                mask=w_mask[None, :] & k_mask[:, None],
                other=0.0,
            )
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        tl.store(
            partial_ptr + split * stride_p_split + positions[:, None] * stride_p_row + w[None, :],
            acc,
            mask=position_mask[:, None] & w_mask[None, :],
        )


@triton.jit
def _expand_kernel(
    partial_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    out_features,
    width,
    stride_out,
    stride_b_slot,
    stride_b_row,
    stride_p_split,
    stride_p_row,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    n_block = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:
        return
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    for m0 in range(start, end, BLOCK_M):
        positions = m0 + tl.arange(0, BLOCK_M)
        position_mask = positions < end
        rows = tl.load(rows_ptr + positions, mask=position_mask, other=0).to(tl.int64)
        update = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for w0 in range(0, width, BLOCK_W):  # one piece unless the slots are wider than BLOCK_W
            w = w0 + tl.arange(0, BLOCK_W)
            w_mask = w < width
            b = tl.load(
                b_ptr + slot * stride_b_slot + n[None, :] * stride_b_row + w[:, None],
                mask=n_mask[None, :] & w_mask[:, None],
                other=0.0,
            )
            h = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
            for split in range(NUM_SPLITS):
                h += tl.load(
                    partial_ptr + split * stride_p_split + positions[:, None] * stride_p_row + w[None, :],
                    mask=position_mask[:, None] & w_mask[None, :],
                    other=0.0,
                )
            if DOT_FP32:
                update += tl.dot(h, b.to(tl.float32), input_precision="ieee")
            else:
                update += tl.dot(h.to(b.dtype), b)
        out_ptrs = out_ptr + rows[:, None] * stride_out + n[None, :]
        out_mask = position_mask[:, None] & n_mask[None, :]
        out = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, (out.to(tl.float32) + update).to(out.dtype), mask=out_mask)


@dataclass(frozen=True)
class StepTileTensors:
    """The device tile arrays of a step (views of one buffer the host rewrites each step)."""

    rows: torch.Tensor  # int32 [max positions]: adapter rows grouped by slot
    tile_slot: torch.Tensor  # int32 [max tiles]
    tile_start: torch.Tensor  # int32 [max tiles]: positions [start, end) of each tile
    tile_end: torch.Tensor


def lora_update(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tiles: StepTileTensors,
    partial: torch.Tensor,
    shape: LaunchShape,
) -> torch.Tensor:
    """`out` [T, N] += each adapter row's (x @ A^T) @ B^T, in place; x [T, K], a [slots, W, K],
    b [slots, N, W], `partial` a flat fp32 buffer of at least split * T * W elements."""
    num_tokens, in_features = x.shape
    out_features = out.shape[1]
    width = a.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    split = shape.split(in_features)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split), BLOCK_K) * BLOCK_K
    partial = partial[: split * num_tokens * width].view(split, num_tokens, width)
    # Wide slots (a large max_lora_rank: qkv's width is 3 ranks) go in pieces, so the expand's B
    # tile (BLOCK_W x BLOCK_N) and the shrink's A tile fit shared memory
    widest = MAX_BLOCK_W_BYTES // x.element_size()
    block_w = min(max(16, triton.next_power_of_2(width)), widest)
    # fp32 dots stay exact (no TF32); the interpreter multiplies bf16 as raw bits (triton 3.6)
    dot_fp32 = x.dtype == torch.float32 or (_INTERPRETED and x.dtype == torch.bfloat16)
    _shrink_kernel[(shape.num_tiles, split, triton.cdiv(width, block_w))](
        x, a, partial, tiles.rows, tiles.tile_slot, tiles.tile_start, tiles.tile_end,
        in_features, width, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), partial.stride(0), partial.stride(1),
        BLOCK_M=shape.block_m, BLOCK_K=BLOCK_K, BLOCK_W=block_w, DOT_FP32=dot_fp32,
    )  # fmt: skip
    _expand_kernel[(shape.num_tiles, triton.cdiv(out_features, BLOCK_N))](
        partial, b, out, tiles.rows, tiles.tile_slot, tiles.tile_start, tiles.tile_end,
        out_features, width,
        out.stride(0), b.stride(0), b.stride(1), partial.stride(0), partial.stride(1),
        NUM_SPLITS=split, BLOCK_M=shape.block_m, BLOCK_N=BLOCK_N, BLOCK_W=block_w, DOT_FP32=dot_fp32,
    )  # fmt: skip
    return out
