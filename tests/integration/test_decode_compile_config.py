"""torch_compile compiles the decode step a CUDA graph captures: on a device without CUDA graphs
the engine refuses to start, naming the setting, instead of running without what was asked for.
(The compiled path itself is tested on a GPU: tests/gpu/test_gpu_engine.py.)"""

from __future__ import annotations

import pytest

from paged_llm.config import CacheConfig, ConfigError, DeviceConfig, EngineConfig, ModelConfig
from paged_llm.engine.llm_engine import LLMEngine


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
