"""Paged attention in Triton for CUDA: one launch per step for a mixed batch of prefills and decodes.

forward() reads only device tensors of the metadata and host ints that a captured CUDA graph keeps
fixed (max_query_len, the batch size and the block-table width), so the decode step can be
captured and replayed. Padding rows of a graph batch (slot -1, seq_len 0) write nothing to the
cache and produce zeros in their own output rows.

Steps with few programs (a decode batch of few sequences, or one prompt chunk over a long cached
context) leave most SMs idle while each program walks the whole context; they split the keys over
several programs (flash-decoding) and merge the partial softmaxes in a second small kernel.
"""

from __future__ import annotations

import torch

from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.attention.triton_kernels import attention_tiles, paged_attention, write_kv_cache
from paged_llm.layers.powers_of_two import prev_power_of_2

DEFAULT_NUM_SMS = 132  # H100 SXM; used when nobody said (tests through the CPU interpreter)
MAX_SPLITS = 16  # the reduce kernel holds [splits, head_dim] partials in registers
MIN_KEYS_PER_SPLIT = 256  # below this the partial writes + reduce cost more than the parallelism wins


def choose_num_splits(num_programs: int, max_seq_len_bound: int, num_sms: int) -> int:
    """How many programs share the keys of one (sequence, kv head, query block); 1 = single pass.

    `num_programs` is the grid without splits (see `estimated_programs`). Only host ints that are
    fixed for a captured graph enter: `max_seq_len_bound` is the block-table width in tokens, not the
    true longest context, so a replayed graph never needs another split. Aim for about two programs
    per SM, keep >= MIN_KEYS_PER_SPLIT keys per split of the longest possible context, and round
    down to a power of two (the reduce kernel's tile).
    """
    if num_programs == 0 or num_programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // num_programs)
    splits = min(MAX_SPLITS, wanted, max_seq_len_bound // MIN_KEYS_PER_SPLIT)
    return max(1, prev_power_of_2(splits))


def estimated_programs(
    num_seqs: int, num_tokens: int, max_query_len: int, num_kv_heads: int, query_block_tokens: int
) -> int:
    """Programs of the attention grid that have work, from host ints a captured graph keeps fixed.

    Decode-only: one per (sequence, kv head). With prompt chunks: the step's tokens packed into
    query blocks, per kv head; exact for one chunk alone (a session turn's new tokens over its long
    history: 201 tokens were 56 programs on 132 SMs, each walking the whole history alone), and it
    counts a mixed-step graph's bucket, not its padding sequence slots.
    """
    if max_query_len == 1:
        return num_seqs * num_kv_heads
    return -(-num_tokens // query_block_tokens) * num_kv_heads


class TritonAttention:
    name = "triton"
    kv_write_in_rope = True  # the decoder may write the cache in its RoPE kernel and call attend()

    def __init__(self, num_splits: int | None = None, num_sms: int = DEFAULT_NUM_SMS) -> None:
        # A fixed split count overrides the heuristic (tests; tuning). Must be a power of two.
        self.fixed_num_splits = num_splits
        self.num_sms = num_sms  # the device's multiprocessors (the runner asks runner/device.py)

    def num_splits(self, query: torch.Tensor, k_cache: torch.Tensor, metadata: AttentionMetadata) -> int:
        if self.fixed_num_splits is not None:
            return self.fixed_num_splits
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        query_block_tokens = attention_tiles(
            metadata.max_query_len, query.shape[1] // num_kv_heads, head_dim
        ).block_q
        programs = estimated_programs(
            num_seqs=metadata.block_tables.shape[0],
            num_tokens=query.shape[0],
            max_query_len=metadata.max_query_len,
            num_kv_heads=num_kv_heads,
            query_block_tokens=query_block_tokens,
        )
        return choose_num_splits(programs, metadata.block_tables.shape[1] * k_cache.shape[1], self.num_sms)

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """`k_scale` / `v_scale`: an FP8 cache's (it holds key / k_scale, saturated)."""
        # The attention kernel reads the new tokens' keys back from the cache, so write first.
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        return self.attend(query, k_cache, v_cache, metadata, scale, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # already holding this step's keys and values
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """forward() without the cache write: the decoder's fused q/k-norm + RoPE kernel wrote the
        step's keys and values (FusedOps.qk_norm_rope_write_kv), one launch per layer fewer."""
        return paged_attention(
            query,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            scale,
            num_splits=self.num_splits(query, k_cache, metadata),
            k_scale=k_scale,
            v_scale=v_scale,
        )
