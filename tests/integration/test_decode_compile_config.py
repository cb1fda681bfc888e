"""torch_compile compiles the decode step a CUDA graph captures: on a device without CUDA graphs
the engine refuses to start, naming the setting, instead of running without what was asked for;
every decode bucket's forward is compiled (traced on the CPU here). The compiled path itself, with
Inductor inside CUDA graphs, is tested on a GPU: tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from paged_llm.config import CacheConfig, ConfigError, DeviceConfig, EngineConfig, ModelConfig
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.runner.cuda_graphs import graph_batch_sizes
from paged_llm.runner.decode_compile import OpaqueToCompiler, compile_decode_forward


def test_torch_compile_without_cuda_graphs_is_refused(tiny_model_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        device=DeviceConfig(device="cpu", torch_compile="default"),
    )
    with pytest.raises(
        ConfigError, match=r"torch_compile='default' .* needs a CUDA device with enable_cuda_graphs"
    ):
        LLMEngine(config, show_progress=False)


def decode_metadata(batch_size: int, block_size_tokens: int, max_blocks_per_seq: int) -> AttentionMetadata:
    """A decode step of `batch_size` one-token sequences, sequence i in block i."""
    return AttentionMetadata(
        num_tokens=batch_size,
        num_seqs=batch_size,
        slot_mapping=torch.arange(batch_size, dtype=torch.int64) * block_size_tokens,
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32),
        seq_lens=torch.ones(batch_size, dtype=torch.int32),
        block_tables=torch.arange(batch_size, dtype=torch.int32)[:, None].repeat(1, max_blocks_per_seq),
        max_query_len=1,
        max_seq_len=1,
        query_lens_host=[1] * batch_size,
        seq_lens_host=[1] * batch_size,
    )


def test_every_decode_bucket_compiles_within_the_recompile_limit(tiny_model_dir):
    """The decode graphs of max_num_seqs 256 (20 buckets, largest first) each get their compiled
    code: none runs past Dynamo's recompile limit, which compile_decode_forward makes an error
    (with a limit of one entry per bucket + 8, bucket 32 hit it: the first layer's residual is None,
    the others' a tensor, two entries per bucket). Traced with the eager backend, on the CPU, with
    the PyTorch ops and the attention outside the graphs, as the CUDA runner sets them up."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
            cache=CacheConfig(num_blocks=300),
            device=DeviceConfig(device="cpu"),
        ),
        show_progress=False,
    )
    runner = engine.core.runner
    for layer in runner.model.layers:
        layer.self_attn.backend = OpaqueToCompiler(layer.self_attn.backend)
    buckets = graph_batch_sizes(256)
    assert len(buckets) == 20
    torch._dynamo.reset()
    counters.clear()
    forward = compile_decode_forward(runner._forward_logits, "default", len(buckets), backend="eager")
    with runner.model.ops.pytorch_ops(), torch.inference_mode():
        for batch_size in reversed(buckets):
            metadata = decode_metadata(batch_size, runner.block_size_tokens, runner.max_blocks_per_seq)
            ids = torch.zeros(batch_size, dtype=torch.int64)
            logits = forward(ids, torch.zeros(batch_size, dtype=torch.int64), metadata)
            assert torch.equal(logits, runner._forward_logits(ids, torch.zeros_like(ids), metadata))
    assert counters["stats"]["unique_graphs"] >= len(buckets)
    torch._dynamo.reset()
