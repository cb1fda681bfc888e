"""How many KV blocks the pool gets: an explicit count, a byte budget, or a share of device memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_llm.config import ConfigError, EngineConfig
from paged_llm.runner.device import Device

if TYPE_CHECKING:
    from paged_llm.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    source: str  # which setting decided the size, for the log line


def plan_kv_cache(
    config: EngineConfig, runner: ModelRunner, device: Device, draft: ModelRunner | None = None
) -> KVCachePlan:
    """`draft`: a draft model (speculative decoding) whose KV cache has as many blocks as the
    target's; each block then costs both, and its CUDA graphs' memory is set aside too."""
    cache = config.cache
    bytes_per_block = runner.kv_bytes_per_block + (draft.kv_bytes_per_block if draft is not None else 0)
    if cache.num_blocks is not None:
        return KVCachePlan(cache.num_blocks, "num_kv_blocks")
    if cache.memory_bytes is not None:
        budget, source = cache.memory_bytes, "kv_cache_memory_bytes"
    elif device.is_cpu:
        budget, source = cache.cpu_memory_bytes, "cpu default"
    else:
        budget, source = runner.profile_free_kv_bytes(cache.gpu_memory_utilization), "gpu_memory_utilization"
        if draft is not None and draft.use_cuda_graphs:
            from paged_llm.runner.memory_profile import graph_pool_bytes

            budget -= graph_pool_bytes(draft, 0)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"KV budget of {budget} bytes ({source}) is smaller than one block ({bytes_per_block} bytes)"
        )
    return KVCachePlan(int(num_blocks), source)
