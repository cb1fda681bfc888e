"""What every attention backend gets each step: where new tokens go and which blocks each sequence reads.

The step's new tokens are flattened into one batch, sequence after sequence:

    tokens:            [ s0: 5 prompt tokens | s1: 1 decode token | s2: chunk of 3 ]
    query_start_loc:   [0, 5, 6, 9]
    seq_lens:          [5, 38, 19]    context each sequence attends to after this step (cached + new)
    slot_mapping[t]:   block_table[pos // block_size] * block_size + pos % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int  # new tokens in this step (T)
    num_seqs: int  # sequences in this step (B); for a captured CUDA graph, its batch bucket
    slot_mapping: torch.Tensor  # [T] int64, KV-cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32, start of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32, context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int  # longest run of new tokens of one sequence
    max_seq_len: int  # longest context
    query_lens_host: list[int]  # host copies, for backends that group sequences in Python
    seq_lens_host: list[int]  # (empty inside a captured CUDA graph, whose lengths change per replay)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
