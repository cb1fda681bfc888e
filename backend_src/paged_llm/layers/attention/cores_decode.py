r"""Decode attention on CUDA cores: one new token a sequence, the head group's rows against the
paged cache without tensor-core operand layouts (`_paged_decode_cores_kernel`). Its outputs, split-KV
partials and padding behaviour are those of triton_kernels._paged_attention_kernel with BLOCK_Q = 1;
triton_backend.py chooses between them (DECODE_KERNEL).

Why a second kernel: over an FP8 cache the tensor-core kernel's operands leave the `ldmatrix` path
(sm90 PTX: scalar shared loads where a bf16 cache has `ldmatrix`), and a decode tile pads the
head group's 2-8 rows to 16 for tl.dot anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.layers.attention.split_kv import reduce_splits, split_partials
from paged_llm.layers.fp8_format import E4M3
from paged_llm.layers.powers_of_two import next_power_of_2

LOG2E = 1.4426950408889634
# The kernel's tiles hold GROUP_P x TILE_N x HEAD_DIM_P values (its accumulator in float32): about
# this many, so that they fit the registers of 4 warps. scripts/bench_attention.py --cores-elements
CORES_PRODUCT_ELEMENTS = 4096


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_cores_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Decode (one new token a sequence) on CUDA cores, without tensor-core operand layouts: the
    cache's values widen in the registers they were loaded into (an FP8 cache takes no trip
    through shared memory; the dot kernel's FP8 operands went through scalar shared loads).

    Every 2-D tile is [GROUP_P * TILE_N, HEAD_DIM_P]: slot r = (head g = r // TILE_N, lane
    n = r % TILE_N), each slot its own online softmax over keys n, n + TILE_N, n + 2 TILE_N, ...
    (head g's query against one key a step). A slot's score is a sum along its own row (lanes of
    a warp), its max, sum and accumulator row are its own: the loop has no reduction across rows
    and no layout change. Each key is loaded once per head of the group (L1 serves the repeats).
    The TILE_N slots of a head merge once, after the loop. Same outputs, splits and partials as
    _paged_attention_kernel with BLOCK_Q = 1."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:  # a padding sequence of the graph
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    slots = tl.arange(0, GROUP_P * TILE_N)
    slot_head = kv_head * GROUP + slots // TILE_N
    slot_valid = slots // TILE_N < GROUP
    lane = slots % TILE_N
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    token = q_start.to(tl.int64)
    q_ptrs = query_ptr + token * stride_qt + slot_head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=slot_valid[:, None] & dim_valid[None, :], other=0.0)
    if KV_FP8:  # the cache holds key / k_scale
        scale_log2 = scale_log2 * k_scale
    q = q.to(tl.float32) * scale_log2  # the scores come out in log2 units
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = seq_len
    else:
        chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N, MIN_SPLIT_KEYS)
        kv_lo = split * chunk
        kv_hi = tl.minimum(seq_len, kv_lo + chunk)
    m_i = tl.full([GROUP_P * TILE_N], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P * TILE_N], tl.float32)
    acc = tl.zeros([GROUP_P * TILE_N, HEAD_DIM_P], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_ptrs = k_cache_ptr + kv_head * stride_ch + dims[None, :]
    v_ptrs = v_cache_ptr + kv_head * stride_ch + dims[None, :]
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + lane
        pos_valid = pos < kv_hi
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        row_off = (block * stride_cb + (pos % BLOCK_SIZE) * stride_cs)[:, None]
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_ptrs + row_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.where(pos_valid, tl.sum(q * k, axis=1), float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slot with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + p
        v = tl.load(v_ptrs + row_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + p[:, None] * v
        m_i = m_new
    # The TILE_N slots of each head merge: weights exp2(m_slot - m_head), empty slots weigh 0.
    m_slots = tl.reshape(m_i, [GROUP_P, TILE_N])
    m_head = tl.max(m_slots, 1)
    m_head_safe = tl.where(m_head == float("-inf"), 0.0, m_head)
    weight = tl.exp2(m_slots - m_head_safe[:, None])
    l_head = tl.sum(weight * tl.reshape(l_i, [GROUP_P, TILE_N]), 1)
    acc_head = tl.sum(tl.reshape(acc, [GROUP_P, TILE_N, HEAD_DIM_P]) * weight[:, :, None], 1)
    if KV_FP8:
        acc_head = acc_head * v_scale
    rows = tl.arange(0, GROUP_P)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc_head / tl.where(l_head == 0.0, 1.0, l_head)[:, None]
        out_ptrs = out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc_ptrs = part_acc_ptr + token * stride_pt + head[:, None] * stride_ph + dims[None, :]
        tl.store(acc_ptrs + split * stride_ps, acc_head, mask=out_mask & (kv_lo < kv_hi))
        ml_off = token * stride_mt + head * stride_mh + split
        tl.store(part_m_ptr + ml_off, m_head, mask=row_valid)
        tl.store(part_l_ptr + ml_off, l_head, mask=row_valid)


def decode_on_cores(
    query: torch.Tensor,  # [T, num_heads, head_dim], one token a sequence (padding rows included)
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], holding this step's keys
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    num_splits: int = 1,  # power of two; > 1 = split-KV
    k_scale: float = 1.0,  # an FP8 cache's: it holds key / k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Each sequence's new token attending over its whole cache (no causal edge inside a step)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or block_tables.shape[0] == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_p, head_dim_p = next_power_of_2(group), next_power_of_2(head_dim)
    tile_n = max(16, CORES_PRODUCT_ELEMENTS // (group_p * head_dim_p))
    parts = split_partials(query, num_splits, head_dim_p, out)
    part_acc, part_m, part_l = parts
    _paged_decode_cores_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables, scale * LOG2E, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits, MIN_SPLIT_KEYS=tile_n,
        KV_FP8=k_cache.dtype == E4M3, num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        reduce_splits(out, parts, query_start_loc, num_seqs, head_dim, head_dim_p, num_splits)
    return out
