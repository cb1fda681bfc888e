"""Portable paged attention in plain PyTorch (CPU, and the NPU fallback).

Decodes (one new token) are batched: their blocks are gathered into one padded context tensor.
Prefill chunks run one sequence at a time; a chunk with no cached context attends to its own keys
with a causal mask, a chunk after cached context gathers the context from the cache:

    keys:     0 ........ start ....... start+q_len-1
    query i:  attends keys j <= start + i          (mask: j <= start + i)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_llm.layers.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Stores new keys/values ([T, kv_heads, head_dim]) at their slots of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` cached entries of one sequence: [num_tokens, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.reshape(-1, *cache.shape[2:])[:num_tokens]


class PortableAttention:
    name = "portable"

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        decode_rows = [i for i, n in enumerate(metadata.query_lens_host) if n == 1]
        if decode_rows:
            self._decode(query, k_cache, v_cache, metadata, decode_rows, scale, output)
        starts = metadata.query_start_loc.tolist() if len(decode_rows) < metadata.num_seqs else []
        for row, query_len in enumerate(metadata.query_lens_host):
            if query_len == 1:
                continue
            start = starts[row]
            seq_len = metadata.seq_lens_host[row]
            q = query[start : start + query_len]
            if seq_len == query_len:  # nothing cached before this chunk
                k, v = key[start : start + query_len], value[start : start + query_len]
                mask = None
            else:
                table = metadata.block_tables[row]
                k = gather_context(k_cache, table, seq_len)
                v = gather_context(v_cache, table, seq_len)
                first_pos = seq_len - query_len
                q_pos = torch.arange(first_pos, seq_len, device=query.device)
                mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1).to(q.dtype),
                v.transpose(0, 1).to(q.dtype),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            output[start : start + query_len] = out.transpose(0, 1)
        return output

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rows: list[int],
        scale: float,
        output: torch.Tensor,
    ) -> None:
        device = query.device
        row_index = torch.tensor(rows, device=device)
        if len(rows) == metadata.num_seqs:
            token_index = metadata.query_start_loc[:-1].long()
        else:
            token_index = metadata.query_start_loc.index_select(0, row_index).long()
        seq_lens = metadata.seq_lens.index_select(0, row_index)
        max_len = max(metadata.seq_lens_host[r] for r in rows)
        block_size = k_cache.shape[1]
        num_blocks = -(-max_len // block_size)
        tables = metadata.block_tables.index_select(0, row_index)[:, :num_blocks]
        # [B * num_blocks, block_size, kv_heads, D] -> [B, kv_heads, L, D]; index_select, not
        # k_cache[tables]: advanced indexing took ~2x as long on CPU (Qwen3-0.6B shape, float32).
        flat_tables = tables.reshape(-1)
        shape = (len(rows), num_blocks * block_size, *k_cache.shape[2:])
        k = k_cache.index_select(0, flat_tables).view(shape)[:, :max_len].transpose(1, 2)
        v = v_cache.index_select(0, flat_tables).view(shape)[:, :max_len].transpose(1, 2)
        valid = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
        q = query.index_select(0, token_index).unsqueeze(2)  # [B, heads, 1, D]
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )
        output.index_copy_(0, token_index, out.squeeze(2))
