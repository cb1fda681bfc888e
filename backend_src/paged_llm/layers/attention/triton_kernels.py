r"""Triton kernels of the paged attention backend: cache write and unified (prefill + decode)
attention with an optional split over the KV positions (flash-decoding; the splits merge in
split_kv.py).

One program of the attention kernel owns one (sequence, kv head, query block[, split]). Its Q tile
packs the query heads that share the kv head into the M dimension, so K/V are read once per group:

    row m of the Q tile (BLOCK_M = BLOCK_Q * GROUP_P rows):
        token  t = q_block * BLOCK_Q + m // GROUP_P      (index among the sequence's new tokens)
        head   h = kv_head * GROUP + m % GROUP_P         (rows with m % GROUP_P >= GROUP are padding)
        pos    p = (seq_len - query_len) + t             (absolute position; sees keys 0 .. p)

    key position j of the sequence -> cache row:
        block_tables[seq, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
        [ blk 7 | blk 2 | blk 9 ]     (BLOCK_SIZE 16) j = 0..15 in blk 7, 16..31 in blk 2, ...
          \_ TILE_N keys per loop step, any multiple or fraction of BLOCK_SIZE

Grids. By sequence, (num_seqs, kv heads, query blocks of the longest query x splits), suits
decodes and lone prompts. A step that mixes one long prompt chunk with many short queries (new
requests joining running decodes) would leave most of such a grid empty, and a mixed-step CUDA
graph, whose longest query is its token bucket, would launch num_seqs x bucket / BLOCK_Q programs.
Such steps take the flat grid (FLAT_GRID): dimension 0 enumerates query blocks of all sequences,

    sequence s owns programs  query_start_loc[s] // BLOCK_Q + s  ..  query_start_loc[s+1] // BLOCK_Q + s
                              (at least its ceil(query_len / BLOCK_Q) blocks, at most one more)

so there are num_tokens // BLOCK_Q + num_seqs of them, and a program finds its sequence by a
binary search over query_start_loc (log2(num_seqs) loads).

With NUM_SPLITS > 1 the keys a query block sees, 0 .. kv_end-1, are cut into NUM_SPLITS chunks
(multiples of TILE_N); every split writes an unnormalised partial (acc, max, sum) and
split_kv.py's reduce merges them. All loop bounds come from device tensors, all grid sizes from
host ints that stay fixed for a captured CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from paged_llm.layers.attention.split_kv import reduce_splits, split_partials
from paged_llm.layers.fp8_format import E4M3, E4M3_MAX
from paged_llm.layers.powers_of_two import next_power_of_2

# The max/sum of the online softmax live in log2 units: exp2 is the fast hardware path.
LOG2E = 1.4426950408889634
PREFILL_MIN_SPLIT_KEYS = 256  # keys per split of a prompt chunk's query block, at least
FP8_MAX = tl.constexpr(E4M3_MAX)  # an FP8 KV cache's bound (a jit function reads constexpr globals)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_inv_scale, v_inv_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding row of a CUDA-graph batch: owns no cache slot
        return
    heads = tl.arange(0, KV_HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_off += heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if KV_FP8:  # divided by the layer's scale (times 1 / scale: a float32 `/` here is approximate,
        # the portable path's is not), saturated (a cast to FP8 need not saturate)
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# The block-table row stride is the widest table of the step in an eager batch (any number) but a
# multiple of 16 in the captured graphs: specializing on it would compile another variant at the
# first eager step of a fresh server (1.0-1.3 s added to that burst's TTFT on an H100). num_seqs
# changes with every eager step likewise.
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _paged_attention_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, num_seqs,
    scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PREFETCH_BLOCKS: tl.constexpr, KV_FP8: tl.constexpr,
    FLAT_GRID: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(1)
    if FLAT_GRID:
        flat_block = tl.program_id(0)
        # The last sequence whose first program is <= flat_block (sequence 0's is program 0).
        lo = tl.full([], 0, tl.int32)  # loop-carried: int32 from the start
        hi = lo + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= flat_block:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(query_start_loc_ptr + seq)
        q_block = flat_block - (q_start // BLOCK_Q + seq)
        split = tl.program_id(2)
    else:
        seq = tl.program_id(0)
        q_block = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:  # the grid is sized for the longest query (or, flat, one more)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # keys cached before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP_P
    head_in_group = rows % GROUP_P
    head = kv_head * GROUP + head_in_group
    row_valid = (q_tok < query_len) & (head_in_group < GROUP)
    q_pos = context_len + q_tok
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # zero padding: it meets K's zero padding in tl.dot
    if DOT_FP32:  # K, V and P follow q's dtype into tl.dot
        q = q.to(tl.float32)
    elif KV_FP8:
        # e4m3 widens to float16 in one instruction (to bfloat16 only through float32, which made
        # the FP8 cache slower to read than a bf16 one); float16 holds the query to its range
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # The last row of the block sees the most keys; padding rows (seq_len 0) get an empty range.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        # Per-sequence chunk of >= MIN_SPLIT_KEYS keys (a multiple of TILE_N): short sequences leave
        # the high splits empty (they write m = -inf).
        chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N, MIN_SPLIT_KEYS)
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)

    # Keys below this are visible to every row of the block: their tiles need no mask (60 -> 54 us a
    # layer for a 201-token chunk over 4,400 keys, H100). Rows that are padding (no token, or a head
    # past GROUP) see them too, from a zero query: finite, and never stored.
    all_visible_hi = tl.minimum(kv_hi, context_len + q_block * BLOCK_Q + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    if KV_FP8:  # the cache holds key / k_scale: the layer's scale goes on the scores, once a tile
        scale_log2 = scale_log2 * k_scale
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_ptrs = k_cache_ptr + kv_head * stride_ch + dims[None, :]  # + a key's cache row offset
    v_ptrs = v_cache_ptr + kv_head * stride_ch + dims[None, :]
    # PREFETCH_BLOCKS: each step loads the next tile's block ids, so the next K/V addresses are known
    # a whole step ahead and the compiler's pipeline can issue those loads early. It pays where few
    # programs share an SM (prompt chunks, split decode: 5-18% a layer on an H200) and costs where
    # many do (unsplit decode of 64 sequences: +19%), so the launcher decides.
    if PREFETCH_BLOCKS:
        ahead = kv_lo + offs_n
        next_block = tl.load(table_ptr + ahead // BLOCK_SIZE, mask=ahead < kv_hi, other=0)
    else:
        next_block = tl.zeros([TILE_N], tl.int32)  # unused
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + offs_n
        pos_valid = pos < kv_hi
        if PREFETCH_BLOCKS:
            block = next_block.to(tl.int64)
            ahead = pos + TILE_N
            next_block = tl.load(table_ptr + ahead // BLOCK_SIZE, mask=ahead < kv_hi, other=0)
        else:
            block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        row_off = (block * stride_cb + (pos % BLOCK_SIZE) * stride_cs)[:, None]
        # Masked loads return 0: an unwritten cache row may hold NaN, and 0 * NaN would leak into acc.
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        # K is loaded as V is (rows of keys) and transposed for the dot: on an H100 that took a
        # 201-token chunk over 4,400 keys from 54 to 49 us a layer.
        k = tl.load(k_ptrs + row_off, mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
        # FP8 keys widen straight into q's dtype (e4m3 values are exact in bf16 and fp32)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
        if start + TILE_N > all_visible_hi:  # the causal edge, the range's end, or padding rows
            visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :] & row_valid[:, None]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + row_off, mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
        v = v.to(q.dtype)  # an FP8 cache's values / v_scale: the scale goes on acc after the loop
        # Rescaled, then accumulated by the dot itself (not added to a separate product): 1-5%
        # faster on an H200 for prompt chunks and decode alike.
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows without keys (padding) give 0
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # A split past the sequence's keys (kv_lo >= kv_hi) leaves its acc unwritten: m = -inf tells
        # the reduce to skip it.
        acc_ptrs = part_acc_ptr + token[:, None] * stride_pt + head[:, None] * stride_ph + dims[None, :]
        tl.store(acc_ptrs + split * stride_ps, acc, mask=q_mask & (kv_lo < kv_hi))
        ml_off = token * stride_mt + head * stride_mh + split
        tl.store(part_m_ptr + ml_off, m_i, mask=row_valid)
        tl.store(part_l_ptr + ml_off, l_i, mask=row_valid)


# ------------------------------------------------------------------------------------- launchers
# TRITON_INTERPRET=1 at import time turns @triton.jit into the CPU interpreter's function type.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # The kernels address the last dim with stride 1; q/k/v are usually strided views of qkv.
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def write_kv_cache(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
    k_scale: float = 1.0,  # an FP8 cache's: it stores key / k_scale
    v_scale: float = 1.0,
) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        KV_HEADS_P=next_power_of_2(num_kv_heads), HEAD_DIM_P=next_power_of_2(head_dim),
        KV_FP8=k_cache.dtype == E4M3,
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )  # fmt: skip


@dataclass(frozen=True)
class AttentionTiles:
    """How `_paged_attention_kernel` cuts its work: BLOCK_M rows of (token, head) per program, i.e.
    BLOCK_Q tokens of GROUP_P heads; TILE_N keys per loop step; warps and pipeline stages."""

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2


SHARED_MEM_MARGIN_BYTES = 8 << 10  # the compiler's own scratch (layout conversions, reductions)


def shared_mem_bytes(tiles: AttentionTiles, head_dim_p: int, q_bytes: int, kv_bytes: int) -> int:
    """Shared memory the attention kernel's pipeline takes: the Q tile, and a K and a V tile per stage."""
    return tiles.block_m * head_dim_p * q_bytes + 2 * tiles.num_stages * tiles.tile_n * head_dim_p * kv_bytes


def fit_shared_memory(
    tiles: AttentionTiles, head_dim_p: int, q_bytes: int, kv_bytes: int, limit_bytes: int
) -> AttentionTiles:
    """Fewer pipeline stages (down to 2) where the device has less shared memory per block than
    the tiles want: 3 stages of 64-key bf16 tiles at head_dim 128 take 112 KiB, more than the
    ~99 KiB of an L4, L40 or RTX 4090; float32 models take twice that."""
    while tiles.num_stages > 2 and (
        shared_mem_bytes(tiles, head_dim_p, q_bytes, kv_bytes) + SHARED_MEM_MARGIN_BYTES > limit_bytes
    ):
        tiles = replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


@functools.cache
def _max_shared_mem_bytes(device_index: int) -> int:
    """What Triton itself checks a compiled kernel against (opt-in shared memory per block)."""
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


# Keys a decode tile reads from an FP8 cache (head_dim <= 128): scripts/bench_attention.py --fp8-tile-n
FP8_DECODE_TILE_N = 64
# Rows of a decode tile over an FP8 cache (scripts/bench_attention.py --fp8-block-m). With 64 rows
# the sm90 compile takes the prompt path's wgmma dots, whose FP8 operands come through `ldmatrix`
# (16 of them, 16 shared loads in the PTX); the 16-row tile's mma dots take them through ~120 scalar
# shared loads. The extra rows are padding (a decode token has only its head group).
FP8_DECODE_BLOCK_M = 16


def is_decode_like(max_query_len: int, group: int) -> bool:
    """One token (or a few) per sequence: the head group's rows fit one 16-row tile."""
    return max_query_len * next_power_of_2(group) <= 16


def attention_tiles(max_query_len: int, group: int, head_dim: int, kv_fp8: bool = False) -> AttentionTiles:
    """tl.dot wants every dim >= 16, so BLOCK_M never drops below 16.

    Decode-like batches (one token times the head group fits 16 rows) take the 16-row tile: the
    kernel is bound by the K/V reads and bigger tiles only add masked rows. Prefills take 64 rows,
    the usual FlashAttention-2 tile for head_dim <= 128 on Hopper. `kv_fp8`: an FP8 cache, whose
    decode tiles may take more keys (FP8_DECODE_TILE_N) for the same bytes.
    """
    group_p = next_power_of_2(group)
    tile_n = 64 if head_dim <= 128 else 32  # keeps K/V tiles + scores within the register file
    if is_decode_like(max_query_len, group):
        block_m = max(16, group_p)
        if kv_fp8 and head_dim <= 128:
            tile_n = FP8_DECODE_TILE_N
            block_m = max(block_m, FP8_DECODE_BLOCK_M)
        return AttentionTiles(block_m, block_m // group_p, tile_n, num_warps=4, num_stages=3)
    # 3 stages with the block ids prefetched: an H200 kernel-only A/B against 2 stages without
    # (41 -> 33 us a layer for 201 tokens over 4,400 cached, 9.5 -> 8.0 without history, 367 -> 348
    # for a 2,048-token chunk over 6,144, 197-201 -> 185-190 for 32 prompts of 512).
    block_m = max(64, group_p)
    return AttentionTiles(block_m, block_m // group_p, tile_n, num_warps=4, num_stages=3)


def uses_flat_grid(num_tokens: int, num_seqs: int, max_query_len: int, block_q: int) -> bool:
    """The flat grid where it launches fewer programs than the grid by sequence: steps that mix a
    long query with other sequences (host ints only, fixed for a captured graph)."""
    return num_tokens // block_q + num_seqs < num_seqs * triton.cdiv(max_query_len, block_q)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    max_query_len: int,
    scale: float,
    num_splits: int = 1,  # power of two; > 1 = split-KV (see triton_backend.choose_num_splits)
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,  # an FP8 cache's: it holds key / k_scale
    v_scale: float = 1.0,
    flat_grid: bool | None = None,  # None: uses_flat_grid decides (tests force either)
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cache (which already holds it)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    assert num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    query = _last_dim_contiguous(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    kv_fp8 = k_cache.dtype == E4M3
    tiles = attention_tiles(max_query_len, group, head_dim, kv_fp8=kv_fp8)
    block_m, block_q, tile_n = tiles.block_m, tiles.block_q, tiles.tile_n
    head_dim_p = max(16, next_power_of_2(head_dim))  # tl.dot's K dim >= 16 (tiny models)
    if query.is_cuda and not _INTERPRETED:
        limit = _max_shared_mem_bytes(query.device.index if query.device.index is not None else 0)
        tiles = fit_shared_memory(tiles, head_dim_p, query.element_size(), k_cache.element_size(), limit)
    parts = split_partials(query, num_splits, head_dim_p, out)
    part_acc, part_m, part_l = parts
    # fp32 inputs would run tl.dot in TF32 (10-bit mantissa) by default; keep them exact. The CPU
    # interpreter multiplies bf16 as raw uint16 bits (triton 3.6), so it gets fp32 dots instead.
    dot_fp32 = query.dtype == torch.float32 or (_INTERPRETED and query.dtype == torch.bfloat16)
    # A query block of a prompt chunk over a short context does its keys alone (H100, 201 new tokens
    # over no history, one layer: 14.8 us single pass, 44.5 us split 4 ways into 64-key pieces).
    # Decode splits stay as fine as TILE_N: one row per program has little to set up.
    decode_like = is_decode_like(max_query_len, group)
    min_split_keys = tile_n if decode_like else max(tile_n, PREFILL_MIN_SPLIT_KEYS)
    # Decode prefetches only when split: a split grid is one the SMs could not fill by itself.
    prefetch_blocks = not decode_like or num_splits > 1
    if flat_grid is None:
        flat_grid = uses_flat_grid(num_tokens, num_seqs, max_query_len, block_q)
    if flat_grid:
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    else:
        grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q) * num_splits)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables, num_seqs, scale * LOG2E, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        GROUP=group, GROUP_P=next_power_of_2(group), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        NUM_SPLITS=num_splits, MIN_SPLIT_KEYS=min_split_keys, DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32", PREFETCH_BLOCKS=prefetch_blocks,
        KV_FP8=k_cache.dtype == E4M3, FLAT_GRID=flat_grid,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        reduce_splits(out, parts, query_start_loc, num_seqs, head_dim, head_dim_p, num_splits)
    return out
