"""Portable paged attention in plain PyTorch (CPU, and the NPU fallback).

Decodes (one new token) are batched: their blocks are gathered into one padded context tensor.
Prefill chunks run one sequence at a time; a chunk with no cached context attends to its own keys
with a causal mask, a chunk after cached context gathers the context from the cache:

    keys:     0 ........ start ....... start+q_len-1
    query i:  attends keys j <= start + i          (mask: j <= start + i)

An FP8 (e4m3) cache stores each key / value divided by its layer's scale, saturated to +-448, and
reads it back times the scale (vLLM's convention); a chunk with no cached context attends to its
keys as the cache holds them (rounded to FP8 and back), as every later step will.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.fp8_format import E4M3, E4M3_MAX


def to_cache(values: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`values` as a cache of `cache_dtype` stores them (FP8: divided by `scale`, saturated: a cast
    need not saturate)."""
    if cache_dtype != E4M3:
        return values.to(cache_dtype)
    # Times the reciprocal, as the Triton kernels do (their float32 division is approximate): both
    # paths store the same bytes.
    return (values.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def from_cache(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache entries as `dtype` values (FP8: times `scale`)."""
    if stored.dtype != E4M3:
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores new keys/values ([T, kv_heads, head_dim]) at their slots of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for cache, values, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        stored = to_cache(values, cache.dtype, scale)
        _as_bits(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, _as_bits(stored))


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes: torch's CPU index_copy_ / index_select take no float8 (2.13)."""
    return tensor.view(torch.uint8) if tensor.dtype == E4M3 else tensor


def _select_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return _as_bits(cache).index_select(0, block_ids).view(cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` cached entries of one sequence: [num_tokens, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = _select_blocks(cache, block_table[:num_blocks])
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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """`k_scale` / `v_scale`: the layer's FP8 cache scales (a cache in the model dtype ignores them)."""
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        output = torch.empty_like(query)
        decode_rows = [i for i, n in enumerate(metadata.query_lens_host) if n == 1]
        if decode_rows:
            self._decode(query, k_cache, v_cache, metadata, decode_rows, scale, output, k_scale, v_scale)
        starts = metadata.query_start_loc.tolist() if len(decode_rows) < metadata.num_seqs else []
        for row, query_len in enumerate(metadata.query_lens_host):
            if query_len == 1:
                continue
            start = starts[row]
            seq_len = metadata.seq_lens_host[row]
            q = query[start : start + query_len]
            if seq_len == query_len:  # nothing cached before this chunk
                k, v = key[start : start + query_len], value[start : start + query_len]
                if k_cache.dtype == E4M3:  # as later steps will read them
                    k = from_cache(to_cache(k, k_cache.dtype, k_scale), q.dtype, k_scale)
                    v = from_cache(to_cache(v, v_cache.dtype, v_scale), q.dtype, v_scale)
                mask = None
            else:
                table = metadata.block_tables[row]
                k = from_cache(gather_context(k_cache, table, seq_len), q.dtype, k_scale)
                v = from_cache(gather_context(v_cache, table, seq_len), q.dtype, v_scale)
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
        k_scale: float,
        v_scale: float,
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
        k = _select_blocks(k_cache, flat_tables).view(shape)[:, :max_len].transpose(1, 2)
        v = _select_blocks(v_cache, flat_tables).view(shape)[:, :max_len].transpose(1, 2)
        valid = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
        q = query.index_select(0, token_index).unsqueeze(2)  # [B, heads, 1, D]
        k, v = from_cache(k, q.dtype, k_scale), from_cache(v, q.dtype, v_scale)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )
        output.index_copy_(0, token_index, out.squeeze(2))
