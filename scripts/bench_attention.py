"""Decode attention alone: one layer's paged attention over a bf16 or an FP8 (e4m3) KV cache, per
batch size and context, timed in a CUDA graph; bytes of K and V read against the card's copy
bandwidth. The kernel and split-KV choice are the engine's (TritonAttention).

    python scripts/bench_attention.py --shape qwen3-0.6b --batch-sizes 64,256 --context 1024 \\
        --json attention.json
    # the FP8 decode tile's keys and rows (layers/attention/triton_kernels.py FP8_DECODE_TILE_N,
    # FP8_DECODE_BLOCK_M), A/B:
    python scripts/bench_attention.py --fp8-tile-n 64,128 --fp8-block-m 16,64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from bench_decode import copy_bandwidth_gb_per_s
from bench_gemv import time_us

from paged_llm.layers.attention import triton_kernels
from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.attention.triton_backend import TritonAttention
from paged_llm.layers.fp8_format import E4M3
from paged_llm.models.random_model import SHAPES

BLOCK_SIZE_TOKENS = 16


def decode_metadata(batch_size: int, context: int, device: torch.device) -> AttentionMetadata:
    """One new token per sequence over `context` cached ones; blocks scattered over the pool."""
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE_TOKENS)
    order = torch.randperm(batch_size * blocks_per_seq, generator=torch.Generator().manual_seed(0))
    block_tables = order.view(batch_size, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch_size,), context + 1, dtype=torch.int32)
    slots = (
        block_tables[:, context // BLOCK_SIZE_TOKENS].long() * BLOCK_SIZE_TOKENS + context % BLOCK_SIZE_TOKENS
    )
    return AttentionMetadata(
        num_tokens=batch_size,
        num_seqs=batch_size,
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(device),
        block_tables=block_tables.to(device),
        max_query_len=1,
        max_seq_len=context + 1,
        query_lens_host=[1] * batch_size,
        seq_lens_host=seq_lens.tolist(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--fp8-tile-n", default="", help="FP8 decode tile sizes to try (default: the engine's)"
    )
    parser.add_argument(
        "--fp8-block-m", default="", help="FP8 decode tile rows to try, of 16,64 (default: the engine's)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    config = SHAPES[args.shape]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // num_heads)
    bandwidth = copy_bandwidth_gb_per_s(device)
    heads = f"{num_heads} q heads, {num_kv_heads} kv heads, head_dim {head_dim}"
    print(f"{torch.cuda.get_device_name(device)}; copy bandwidth {bandwidth:.0f} GB/s; {args.shape}: {heads}")
    print(f"context {args.context}")
    tile_ns = [int(t) for t in args.fp8_tile_n.split(",") if t] or [triton_kernels.FP8_DECODE_TILE_N]
    block_ms = [int(m) for m in args.fp8_block_m.split(",") if m] or [triton_kernels.FP8_DECODE_BLOCK_M]
    fp8_tiles = [(tile_n, block_m) for block_m in block_ms for tile_n in tile_ns]
    backend = TritonAttention(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    rows = []
    print(f"{'batch':>6} {'cache':>10} {'us':>9} {'GB/s':>7} {'of copy':>8}")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        metadata = decode_metadata(batch_size, args.context, device)
        num_blocks = int(metadata.block_tables.numel())
        query = torch.randn(batch_size, num_heads, head_dim, dtype=torch.bfloat16, device=device)
        shape = (num_blocks, BLOCK_SIZE_TOKENS, num_kv_heads, head_dim)
        # K and V apart: one tensor for both would read each tile's V from L2, just after its K
        bf16 = (
            torch.randn(shape, dtype=torch.bfloat16, device=device),
            torch.randn(shape, dtype=torch.bfloat16, device=device),
        )
        caches = {"bf16": bf16, "fp8": tuple(c.clamp(-448, 448).to(E4M3) for c in bf16)}
        for name, (k_cache, v_cache) in caches.items():
            for tile_n, block_m in fp8_tiles if name == "fp8" else [(None, None)]:
                if tile_n is not None:
                    triton_kernels.FP8_DECODE_TILE_N = tile_n
                    triton_kernels.FP8_DECODE_BLOCK_M = block_m
                label = name if tile_n is None else f"{name}/{tile_n}x{block_m}"
                # one copy: K and V of 64+ sequences at 1k tokens are far beyond L2 already
                us = time_us(
                    lambda _copy, q=query, k=k_cache, v=v_cache, m=metadata: backend.attend(
                        q, k, v, m, head_dim**-0.5
                    ),
                    num_copies=1,
                )
                kv_bytes = (
                    2 * batch_size * (args.context + 1) * num_kv_heads * head_dim * k_cache.element_size()
                )
                gb_per_s = kv_bytes / us / 1e3
                rows.append(dict(batch_size=batch_size, cache=label, us=us, gb_per_s=gb_per_s))
                print(
                    f"{batch_size:>6} {label:>10} {us:>9.1f} {gb_per_s:>7.0f} {gb_per_s / bandwidth:>7.1%}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"card": torch.cuda.get_device_name(device), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
