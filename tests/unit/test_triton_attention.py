"""TritonAttention against PortableAttention: on CPU through the Triton interpreter, and with a GPU
the same tests run the compiled kernels on CUDA.

Metadata comes from the real InputBuffers.prepare (what ModelRunner uses), fed with stand-in
scheduler items. The Triton run gets a cache whose unused slots hold NaN: a masked load that leaked
would show up.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import; GPU runs compile for real
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.attention.portable import PortableAttention
from paged_llm.layers.attention.triton_backend import TritonAttention, choose_num_splits, estimated_programs
from paged_llm.runner.input_buffers import InputBuffers

NUM_BLOCKS = 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the device the comparison tests run on


def build_metadata(
    chunks: list[tuple[int, int]], block_size: int, device: torch.device, seed: int = 0
) -> AttentionMetadata:
    """chunks: (num_computed_tokens, num_new_tokens) per sequence; blocks are scattered at random."""
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    scheduled = []
    for computed, new in chunks:
        num_blocks = -(-(computed + new) // block_size)
        scheduled.append(
            SimpleNamespace(
                seq=SimpleNamespace(all_token_ids=[0] * (computed + new), num_known_tokens=computed + new),
                num_computed_tokens=computed,
                num_new_tokens=new,
                block_ids=[free.pop() for _ in range(num_blocks)],
                needs_sample=False,
                draft_token_ids=[],
            )
        )
    num_tokens = sum(new for _, new in chunks)
    buffers = InputBuffers(
        max_num_tokens=num_tokens,
        max_num_seqs=len(chunks),
        max_blocks_per_seq=max(len(item.block_ids) for item in scheduled),
        block_size_tokens=block_size,
        device=device,
        pin_memory=device.type == "cuda",
    )
    return buffers.prepare(SimpleNamespace(scheduled=scheduled, num_batched_tokens=num_tokens)).metadata


def context_slots(metadata: AttentionMetadata, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0 .. seq_len-1 of every sequence (cached context + new tokens)."""
    slots = []
    for row, seq_len in enumerate(metadata.seq_lens_host):
        pos = torch.arange(seq_len)
        table = metadata.block_tables[row].cpu().long()
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return torch.cat(slots)


def make_inputs(metadata, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = metadata.num_tokens

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)  # strided q/k/v views, as in the decoder
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    return (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
        randn(*shape),
        randn(*shape),
    )


def run_both(
    chunks, heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32, device=DEVICE, splits=None
):
    device = torch.device(device)
    metadata = build_metadata(chunks, block_size, device)
    q, k, v, k_cache, v_cache = make_inputs(metadata, heads, kv_heads, head_dim, block_size, dtype, device)
    scale = head_dim**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = PortableAttention().forward(q, k, v, ref_k, ref_v, metadata, scale)
    valid = context_slots(metadata, block_size).to(device)
    tri_k, tri_v = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    for tri, src in ((tri_k, k_cache), (tri_v, v_cache)):
        tri.view(-1, kv_heads, head_dim)[valid] = src.view(-1, kv_heads, head_dim)[valid]
    actual = TritonAttention(num_splits=splits).forward(q, k, v, tri_k, tri_v, metadata, scale)
    # The cache writes: every context slot (incl. the new tokens' slots) matches the portable cache.
    for tri, ref in ((tri_k, ref_k), (tri_v, ref_v)):
        assert torch.equal(tri.view(-1, kv_heads, head_dim)[valid], ref.view(-1, kv_heads, head_dim)[valid])
    return actual, expected


def assert_close(actual, expected, atol=1e-4):
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, atol=atol, rtol=atol)


# ------------------------------------------------------------------------------------ batches
# Contexts past 64 keys (one KV tile) exercise the online-softmax rescale and several splits.
DECODES = [(3, 1), (12, 1), (0, 1), (140, 1)]
MIXED = [(0, 7), (9, 1), (70, 6), (150, 1), (0, 1)]


@pytest.mark.parametrize(
    "chunks",
    [DECODES, [(0, 70)], [(75, 6)], MIXED],
    ids=["decode", "prefill", "chunked_prefill", "mixed"],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_portable(chunks, block_size):
    assert_close(*run_both(chunks, block_size=block_size))


@pytest.mark.parametrize("heads_per_kv", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_gqa_and_head_dim(heads_per_kv, head_dim):
    assert_close(*run_both(MIXED, heads=2 * heads_per_kv, kv_heads=2, head_dim=head_dim))


def test_odd_group_and_long_prefill_spanning_query_blocks():
    # group 3 (padded to 4 rows) and a 40-token chunk: several query blocks of one sequence.
    assert_close(*run_both([(5, 40), (17, 1)], heads=6, kv_heads=2, block_size=8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    assert_close(*run_both(MIXED, dtype=dtype), atol=2e-2)


@pytest.fixture
def nan_filled_empty(monkeypatch):
    """torch.empty gives NaN-filled tensors: a partial (split) that the reduce reads without the
    attention kernel having written it shows up as NaN."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", empty)


# A session turn: new tokens over a long cached history, in several query blocks, next to decodes.
LONG_CONTEXT_CHUNK = [(300, 40), (9, 1), (0, 3)]


@pytest.mark.parametrize(
    "chunks", [DECODES, MIXED, LONG_CONTEXT_CHUNK], ids=["decode", "mixed", "long_context_chunk"]
)
def test_split_kv_matches_single_pass(chunks, nan_filled_empty):
    single, expected = run_both(chunks, splits=1)
    split, _ = run_both(chunks, splits=4)
    assert_close(split, expected)
    assert_close(split, single, atol=1e-5)


def test_split_prefill_with_mixed_graph_padding_leaves_real_rows_exact(nan_filled_empty):
    """A mixed-step graph's layout: the step's tokens, then padding tokens of no sequence, and
    padding sequence slots with query length 0 and seq_len 0 (runner/cuda_graphs.py)."""
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    device = torch.device(DEVICE)
    metadata = build_metadata(LONG_CONTEXT_CHUNK, block_size, device)
    q, k, v, k_cache, v_cache = make_inputs(
        metadata, heads, kv_heads, head_dim, block_size, torch.float32, device
    )
    real = TritonAttention(num_splits=1).forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, 0.25)
    pad_tokens, pad_seqs = 5, 3
    num_tokens = metadata.num_tokens
    nan_tokens = torch.full((pad_tokens, kv_heads, head_dim), float("nan"), device=device)
    padded = replace(
        metadata,
        num_tokens=num_tokens + pad_tokens,
        slot_mapping=torch.cat([metadata.slot_mapping, torch.full((pad_tokens,), -1, device=device)]),
        query_start_loc=torch.cat(
            [metadata.query_start_loc, torch.full((pad_seqs,), num_tokens, dtype=torch.int32, device=device)]
        ),
        seq_lens=torch.cat([metadata.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32, device=device)]),
        block_tables=torch.cat(
            [
                metadata.block_tables,
                torch.zeros(pad_seqs, metadata.block_tables.shape[1], device=device).int(),
            ]
        ),
        max_query_len=metadata.max_query_len + pad_tokens,  # the bucket
    )
    q_pad = torch.cat([q, torch.full((pad_tokens, heads, head_dim), float("nan"), device=device)])
    k_pad, v_pad = torch.cat([k, nan_tokens]), torch.cat([v, nan_tokens])
    pk, pv = k_cache.clone(), v_cache.clone()
    out = TritonAttention(num_splits=4).forward(q_pad, k_pad, v_pad, pk, pv, padded, 0.25)
    assert not pk.isnan().any() and not pv.isnan().any()
    assert_close(out[:num_tokens], real, atol=1e-5)


def test_padding_rows_leave_real_rows_exact():
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    device = torch.device(DEVICE)
    metadata = build_metadata(DECODES, block_size, device)
    q, k, v, k_cache, v_cache = make_inputs(
        metadata, heads, kv_heads, head_dim, block_size, torch.float32, device
    )
    real = TritonAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, 0.25)
    # A CUDA-graph batch padded by 3 rows: one token each, slot -1, seq_len 0, block table of zeros.
    pad = 3
    padded = replace(
        metadata,
        num_tokens=metadata.num_tokens + pad,
        slot_mapping=torch.cat([metadata.slot_mapping, torch.full((pad,), -1, device=device)]),
        query_start_loc=torch.cat(
            [
                metadata.query_start_loc,
                metadata.query_start_loc[-1] + torch.arange(1, pad + 1, dtype=torch.int32, device=device),
            ]
        ),
        seq_lens=torch.cat([metadata.seq_lens, torch.zeros(pad, dtype=torch.int32, device=device)]),
        block_tables=torch.cat(
            [metadata.block_tables, torch.zeros(pad, metadata.block_tables.shape[1], device=device).int()]
        ),
    )
    nan_rows = torch.full((pad, kv_heads, head_dim), float("nan"), device=device)
    q_pad = torch.cat([q, torch.full((pad, heads, head_dim), float("nan"), device=device)])
    k_pad, v_pad = torch.cat([k, nan_rows]), torch.cat([v, nan_rows])
    for splits in (1, 4):
        pk, pv = k_cache.clone(), v_cache.clone()
        out = TritonAttention(num_splits=splits).forward(q_pad, k_pad, v_pad, pk, pv, padded, 0.25)
        assert not pk.isnan().any() and not pv.isnan().any()  # padding rows wrote nothing
        assert_close(out[: metadata.num_tokens], real, atol=1e-6)


# New requests joining running decodes: one long prompt chunk among short queries, and padding
# sequence slots (query length 0) at the end, as in a mixed-step graph.
JOINING = [(20, 1), (0, 45), (7, 1), (66, 2), (130, 1), (0, 9), (3, 1)]


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("pad_seqs", [0, 5])
def test_flat_grid_equals_grid_by_sequence(splits, pad_seqs, nan_filled_empty):
    """Both grids give the same output for every real token (exactly: the same programs' work, only
    numbered differently), with padding slots of length 0 past the last real sequence."""
    from paged_llm.layers.attention.triton_kernels import paged_attention

    block_size, heads, kv_heads, head_dim = 4, 6, 2, 16  # group 3: 4 rows a token, 16 tokens a block
    device = torch.device(DEVICE)
    metadata = build_metadata(JOINING, block_size, device)
    q, k, v, k_cache, v_cache = make_inputs(
        metadata, heads, kv_heads, head_dim, block_size, torch.float32, device
    )
    TritonAttention(num_splits=1).forward(q, k, v, k_cache, v_cache, metadata, 0.25)  # cache the new keys
    num_tokens = metadata.num_tokens
    query_start_loc = torch.cat(
        [metadata.query_start_loc, torch.full((pad_seqs,), num_tokens, dtype=torch.int32, device=device)]
    )
    seq_lens = torch.cat([metadata.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32, device=device)])
    tables = torch.cat(
        [metadata.block_tables, torch.zeros(pad_seqs, metadata.block_tables.shape[1], device=device).int()]
    )
    args = (q, k_cache, v_cache, query_start_loc, seq_lens, tables, metadata.max_query_len, 0.25)
    by_sequence = paged_attention(*args, num_splits=splits, flat_grid=False)
    flat = paged_attention(*args, num_splits=splits, flat_grid=True)
    assert not flat.isnan().any()
    torch.testing.assert_close(flat, by_sequence, atol=1e-6, rtol=1e-6)
    expected = PortableAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, 0.25)
    assert_close(flat, expected)


def test_flat_grid_where_it_launches_fewer_programs():
    from paged_llm.layers.attention.triton_kernels import uses_flat_grid

    # 64 decodes + one 512-token prompt, 32-token query blocks: 16 + 65 programs a kv head, not 65 x 16.
    assert uses_flat_grid(num_tokens=576, num_seqs=65, max_query_len=512, block_q=32)
    # A mixed-step graph of 256 slots on its 2048-token bucket: 64 + 256, not 256 x 64.
    assert uses_flat_grid(num_tokens=2048, num_seqs=256, max_query_len=2048, block_q=32)
    assert not uses_flat_grid(num_tokens=64, num_seqs=64, max_query_len=1, block_q=8)  # decodes
    assert not uses_flat_grid(num_tokens=500, num_seqs=1, max_query_len=500, block_q=32)  # one prompt
    assert not uses_flat_grid(num_tokens=512, num_seqs=4, max_query_len=128, block_q=32)  # equal prompts


def test_split_heuristic():
    # 1 sequence x 8 kv heads on 132 SMs with a 4096-token table: split as far as allowed.
    assert choose_num_splits(1 * 8, 4096, 132) == 16
    assert choose_num_splits(8 * 8, 4096, 132) == 4
    assert choose_num_splits(64 * 8, 4096, 132) == 1  # the batch already fills the GPU
    assert choose_num_splits(1 * 8, 256, 132) == 1  # too short to be worth a reduce


def test_programs_of_decodes_and_of_prompt_chunks():
    # Decode-only: (sequence, kv head) pairs.
    assert (
        estimated_programs(num_seqs=3, num_tokens=3, max_query_len=1, num_kv_heads=8, query_block_tokens=8)
        == 24
    )
    # A session turn of 201 new tokens (Qwen3-0.6B: 8 kv heads, 32-token query blocks): 7 x 8 = 56
    # programs, so over a 4,608-token table it splits 4 ways; a fresh 201-token prompt (its table is
    # 13 blocks of 16) does not split.
    turn = estimated_programs(
        num_seqs=1, num_tokens=201, max_query_len=201, num_kv_heads=8, query_block_tokens=32
    )
    assert turn == 56
    assert choose_num_splits(turn, 4608, 132) == 4
    assert choose_num_splits(turn, 13 * 16, 132) == 1
    # A mixed-step graph counts its token bucket, not its 32 sequence slots; 8 x 128-token prompts
    # fill the GPU.
    assert estimated_programs(32, 256, 256, 8, 32) == 64
    assert choose_num_splits(estimated_programs(8, 1024, 128, 8, 32), 4096, 132) == 1


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_bf16_matches_portable(head_dim):
    chunks = [(0, 37), (300, 1), (70, 20), (1000, 1), (0, 1)]
    assert_close(*run_both(chunks, 8, 2, head_dim, 16, torch.bfloat16, "cuda"), atol=2e-2)
    assert_close(*run_both(chunks[1::2], 8, 2, head_dim, 16, torch.bfloat16, "cuda", splits=8), atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_capture_and_replay():
    device, block_size, heads, kv_heads, head_dim = torch.device("cuda"), 16, 8, 2, 128
    backend = TritonAttention()
    first = build_metadata([(40, 1), (300, 1), (5, 1)], block_size, device, seed=1)
    q, k, v, k_cache, v_cache = make_inputs(
        first, heads, kv_heads, head_dim, block_size, torch.bfloat16, device
    )
    static = [t.clone() for t in (q, k, v)]
    meta = replace(first, block_tables=torch.zeros(3, 64, dtype=torch.int32, device=device))  # 4 splits
    meta.block_tables[:, : first.block_tables.shape[1]] = first.block_tables
    backend.forward(*static, k_cache, v_cache, meta, head_dim**-0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(*static, k_cache, v_cache, meta, head_dim**-0.5)
    # Replay with the next step's inputs copied into the captured tensors (longer contexts).
    second = build_metadata([(41, 1), (301, 1), (6, 1)], block_size, device, seed=1)
    nq, nk, nv, _, _ = make_inputs(
        second, heads, kv_heads, head_dim, block_size, torch.bfloat16, device, seed=2
    )
    for dst, src in zip(static, (nq, nk, nv)):
        dst.copy_(src)
    for name in ("slot_mapping", "query_start_loc", "seq_lens"):
        getattr(meta, name).copy_(getattr(second, name))
    meta.block_tables.zero_()
    meta.block_tables[:, : second.block_tables.shape[1]] = second.block_tables
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    graph.replay()
    expected = PortableAttention().forward(nq, nk, nv, ref_k, ref_v, second, head_dim**-0.5)
    assert_close(graph_out, expected, atol=2e-2)


class _WritesItsOwnKV(TritonAttention):
    kv_write_in_rope = False


def test_decoder_attention_with_the_kv_written_in_rope_equals_the_separate_write():
    """models/decoder.Attention on Triton ops: the fused path (RoPE kernel writes the cache,
    TritonAttention.attend) gives the same output and the same cache as write + forward."""
    from paged_llm.layers.fused_ops import FusedOps
    from paged_llm.models.decoder import Attention, RMSNorm, RotaryEmbedding
    from paged_llm.models.hf_config import ModelSpec, RopeSpec

    device, block_size, heads, kv_heads, head_dim = torch.device(DEVICE), 4, 4, 2, 16
    spec = ModelSpec(
        architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=32, num_layers=1, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=64, rms_norm_eps=1e-6,
        rope=RopeSpec(theta=1e6), max_position_embeddings=512, tie_word_embeddings=False,
        attention_bias=False, qk_norm=True, checkpoint_dtype="float32",
    )  # fmt: skip
    metadata = build_metadata(MIXED, block_size, device)
    rotary = RotaryEmbedding(head_dim, spec.rope, max_positions=512)
    rotary.build(device, torch.float32)
    positions = torch.cat(
        [torch.arange(seq_len - query_len, seq_len) for query_len, seq_len in
         zip(metadata.query_lens_host, metadata.seq_lens_host, strict=True)]
    ).to(device)  # fmt: skip
    hidden = torch.randn(metadata.num_tokens, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    hidden = hidden.to(device)
    results = []
    for backend in (TritonAttention(), _WritesItsOwnKV()):
        torch.manual_seed(0)
        layer = Attention(spec, backend, FusedOps(use_triton=True)).to(device)
        _, _, _, k_cache, v_cache = make_inputs(
            metadata, heads, kv_heads, head_dim, block_size, torch.float32, device
        )
        norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps).to(device)
        out, _ = layer(positions, hidden, None, norm, (k_cache, v_cache), metadata, rotary)
        results.append((out, k_cache, v_cache))
    (fused, fused_k, fused_v), (separate, separate_k, separate_v) = results
    assert torch.equal(fused_k, separate_k) and torch.equal(fused_v, separate_v)
    assert torch.equal(fused, separate)


def test_pipeline_stages_fit_the_devices_shared_memory():
    from paged_llm.layers.attention.triton_kernels import attention_tiles, fit_shared_memory, shared_mem_bytes

    prefill, decode = attention_tiles(201, 2, 128), attention_tiles(1, 2, 128)
    assert (prefill.block_m, prefill.tile_n, prefill.num_stages) == (64, 64, 3)
    assert shared_mem_bytes(prefill, 128, 2, 2) == 112 << 10  # Q 16 KiB + 3 x (K 16 + V 16) KiB
    h100, a100, l40 = 227 << 10, 163 << 10, 99 << 10  # opt-in shared memory per block
    assert fit_shared_memory(prefill, 128, 2, 2, h100).num_stages == 3
    assert fit_shared_memory(prefill, 128, 2, 2, a100).num_stages == 3
    assert fit_shared_memory(prefill, 128, 2, 2, l40).num_stages == 2  # 80 KiB
    assert fit_shared_memory(decode, 128, 2, 2, l40).num_stages == 2  # 4 + 3 x 32 KiB would not fit
    assert fit_shared_memory(prefill, 128, 4, 4, h100).num_stages == 2  # float32: 224 KiB at 3 stages
    assert fit_shared_memory(decode, 128, 4, 4, h100).num_stages == 3
    small = fit_shared_memory(prefill, 128, 4, 4, 1 << 10)  # never below 2 stages: as before
    assert small.num_stages == 2 and (small.block_m, small.tile_n) == (64, 64)
