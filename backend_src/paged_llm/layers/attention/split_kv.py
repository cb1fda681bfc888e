"""Split-KV (flash-decoding) partials and their merge, shared by the attention kernels: a program
that owns one split of a (sequence, kv head, query block)'s keys writes an unnormalised partial
(acc, max, sum in log2 units); `_reduce_splits_kernel` merges the splits of each (token, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# num_seqs changes with every eager step: specializing on it (== 1, multiple of 16) would compile
# new variants while serving.
@triton.jit(do_not_specialize=["num_seqs"])
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, num_seqs,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): a long prefill chunk's tokens merge in parallel."""
    tok64 = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Tokens past the last sequence's (a mixed-step graph's padding) belong to no sequence: the
    # attention kernel wrote no partials for them.
    if tok64 >= tl.load(query_start_loc_ptr + num_seqs):
        return
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    ml_off = tok64 * stride_mt + head * stride_mh + splits
    m = tl.load(part_m_ptr + ml_off)
    l_part = tl.load(part_l_ptr + ml_off)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty split -> 0
    denom = tl.sum(weight * l_part, 0)
    acc_ptrs = part_acc_ptr + tok64 * stride_pt + head * stride_ph
    has_keys = m > float("-inf")  # an empty split wrote no acc (it may hold anything)
    acc = tl.load(
        acc_ptrs + splits[:, None] * stride_ps + dims[None, :],
        mask=has_keys[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    out_ptrs = out_ptr + tok64 * stride_ot + head * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def split_partials(
    query: torch.Tensor, num_splits: int, head_dim_p: int, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-KV partials (acc, max, sum); `out` stands in where there is no split (never read:
    NUM_SPLITS == 1 removes those code paths at compile time)."""
    if num_splits == 1:
        return out, out, out
    num_tokens, num_heads, _ = query.shape
    device = query.device
    shape = (num_tokens, num_heads, num_splits)
    part_acc = torch.empty((*shape, head_dim_p), dtype=torch.float32, device=device)
    part_m = torch.empty(shape, dtype=torch.float32, device=device)
    return part_acc, part_m, torch.empty_like(part_m)


def reduce_splits(
    out: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], query_start_loc: torch.Tensor,
    num_seqs: int, head_dim: int, head_dim_p: int, num_splits: int,
) -> None:  # fmt: skip
    part_acc, part_m, part_l = parts
    num_tokens, num_heads, _ = out.shape
    _reduce_splits_kernel[(num_tokens, num_heads)](
        out, part_acc, part_m, part_l, query_start_loc, num_seqs,
        out.stride(0), out.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=num_splits,
        num_warps=1 if head_dim_p * num_splits <= 1024 else 4,
    )  # fmt: skip
