"""How much device memory the KV pool may take: profile a worst-case step, subtract it.

It reads the runner through `ProfiledRunner`, the part of a ModelRunner (runner/model_runner.py) it
needs, so the runner can call it without the two modules importing each other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.parallel import ShardPlan
from paged_llm.models.decoder import CausalLM
from paged_llm.models.hf_config import ModelSpec
from paged_llm.runner.cuda_graphs import graph_batch_sizes, mixed_step_token_buckets
from paged_llm.runner.device import Device

if TYPE_CHECKING:
    from paged_llm.lora.manager import LoRAManager

logger = logging.getLogger(__name__)
GRAPH_POOL_MARGIN_BYTES = 64 << 20  # allocator rounding, cuBLAS workspaces of the capture stream


class ProfiledRunner(Protocol):
    """What the memory profile reads of a ModelRunner, and `graph_pool_reserve_bytes`, which it sets."""

    model: CausalLM | None
    device: Device
    spec: ModelSpec
    shard: ShardPlan
    dtype: torch.dtype
    max_model_len: int
    block_size_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    use_cuda_graphs: bool
    graph_pool_reserve_bytes: int | None
    lora: LoRAManager | None


def graph_pool_bytes(runner: ProfiledRunner, step_peak_bytes: int) -> int:
    """Estimated private memory of the CUDA graphs captured after the KV pool: the outputs every
    graph keeps (a decode graph: a logits row per batch slot; a mixed-step graph: a hidden-state row
    per sampled row, cuda_graphs.MixedStepGraphs.num_rows), plus the largest graph's transient
    activations, taken as the worst step's peak scaled to that graph's tokens (the graphs share one
    pool, so smaller graphs reuse those blocks), plus a margin. The runner measures the real figure
    after capture and logs both."""
    element_bytes = torch.finfo(runner.dtype).bits // 8
    buckets = mixed_step_token_buckets(runner.max_num_batched_tokens)
    hidden_rows = sum(buckets)  # a bucket keeps at most a row a token
    logits_rows = sum(graph_batch_sizes(runner.max_num_seqs))
    # LoRA with its kernels captures every graph twice (runner.lora_graphs): twice the outputs
    variants = 2 if runner.lora is not None and runner.lora.slots.uses_kernels else 1
    outputs_bytes = (
        variants
        * element_bytes
        * (logits_rows * runner.spec.vocab_size + hidden_rows * runner.spec.hidden_size)
    )
    largest_graph_tokens = max([runner.max_num_seqs, *buckets])
    share = min(1.0, largest_graph_tokens / runner.max_num_batched_tokens)
    return outputs_bytes + int(step_peak_bytes * share) + GRAPH_POOL_MARGIN_BYTES


@torch.inference_mode()
def profile_free_kv_bytes(runner: ProfiledRunner, gpu_memory_utilization: float) -> int:
    """The utilisation share of device memory, minus what is in use now (weights, CUDA context, other
    processes), minus the peak of a worst-case step (the whole token budget, logits for
    max_num_seqs rows and the sampler's float32 copy), minus the graphs' pool (graph_pool_bytes)."""
    assert runner.model is not None
    device = runner.device
    torch_device = device.torch_device
    spec = runner.spec
    device.synchronize()
    free_bytes, total_bytes = device.memory_info()
    device.reset_peak_stats()
    baseline = device.allocated_bytes()

    num_tokens = runner.max_num_batched_tokens
    seq_len = min(num_tokens, runner.max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // runner.block_size_tokens)
    num_blocks = len(lens) * blocks_per_seq
    shape = (num_blocks, runner.block_size_tokens, runner.shard.num_kv_heads, spec.head_dim)
    scratch = torch.zeros(
        shape, dtype=runner.dtype, device=torch_device
    )  # one throwaway cache for all layers
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    metadata = AttentionMetadata(
        num_seqs=len(lens),
        num_tokens=num_tokens,
        slot_mapping=torch.cat(
            [
                torch.arange(n, device=torch_device) + i * blocks_per_seq * runner.block_size_tokens
                for i, n in enumerate(lens)
            ]
        ),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=torch_device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=torch_device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=torch_device).view(
            len(lens), blocks_per_seq
        ),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_lens_host=lens,
        seq_lens_host=lens,
    )
    positions = torch.cat([torch.arange(n, device=torch_device) for n in lens])
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=torch_device)
    if runner.lora is not None:  # the adapter path's temporaries (no fused norm + projection)
        runner.lora.use_slot_for_profiling(num_tokens)
    try:
        hidden = runner.model(input_ids, positions, [(scratch, scratch)] * spec.num_layers, metadata)
    finally:
        if runner.lora is not None:
            runner.lora.end_profiling()
    logits = runner.model.compute_logits(hidden[: min(runner.max_num_seqs, num_tokens)])
    torch.log_softmax(logits.float(), dim=-1)
    device.synchronize()
    peak_bytes = device.peak_allocated_bytes() - baseline
    del scratch, hidden, logits
    device.empty_cache()

    used_bytes = total_bytes - free_bytes
    reserve = graph_pool_bytes(runner, peak_bytes) if runner.use_cuda_graphs else 0
    runner.graph_pool_reserve_bytes = reserve
    budget = int(total_bytes * gpu_memory_utilization) - used_bytes - peak_bytes - reserve
    logger.info(
        "memory profile: %.1f GiB total, %.1f GiB in use, worst step peak %.2f GiB, CUDA graphs %.2f GiB"
        " -> KV budget %.1f GiB",
        total_bytes / 2**30,
        used_bytes / 2**30,
        peak_bytes / 2**30,
        reserve / 2**30,
        budget / 2**30,
    )
    return max(budget, 0)
