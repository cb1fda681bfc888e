from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_llm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SessionConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.sampling_params import SamplingParams


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def make_engine(model_dir: Path, core_mode: str = "inprocess", **overrides) -> LLMEngine:
    """A float32 CPU engine on `model_dir`; overrides go to the cache/scheduler sections. With
    core_mode="process" the caller shuts it down (the `engines` fixture does); `sessions` is the
    SessionConfig, `speculative` the SpeculativeConfig, `tensor_parallel_size` the ranks,
    `enable_onednn_linear` and `device` the DeviceConfig's, `load_format` and `quantization` the
    ModelConfig's, `lora` the LoRAConfig."""
    sessions = overrides.pop("sessions", SessionConfig())
    tensor_parallel_size = overrides.pop("tensor_parallel_size", 1)
    load_format = overrides.pop("load_format", "safetensors")
    quantization = overrides.pop("quantization", "")
    speculative = overrides.pop("speculative", SpeculativeConfig())
    structured_output = overrides.pop("structured_output", StructuredOutputConfig())
    enable_onednn_linear = overrides.pop("enable_onednn_linear", True)
    device = overrides.pop("device", "auto")
    lora = overrides.pop("lora", LoRAConfig())
    cache_fields = {
        "block_size_tokens",
        "num_blocks",
        "enable_prefix_caching",
        "memory_bytes",
        "kv_cache_dtype",
    }
    cache = {k: v for k, v in overrides.items() if k in cache_fields}
    scheduler = {k: v for k, v in overrides.items() if k not in cache_fields and k != "max_model_len"}
    cache.setdefault("num_blocks", 2048)
    config = EngineConfig(
        model=ModelConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=overrides.get("max_model_len"),
            load_format=load_format,
            quantization=quantization,
        ),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**scheduler),
        sessions=sessions,
        speculative=speculative,
        structured_output=structured_output,
        lora=lora,
        device=DeviceConfig(
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            enable_onednn_linear=enable_onednn_linear,
        ),
    )
    return LLMEngine(config, show_progress=False, core_mode=core_mode)


def run_to_completion(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    check_integrity: bool = True,
) -> list[list[Completion]]:
    """Adds every prompt at once, steps until done; returns the n completions of each request."""
    all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    results: dict[str, list[Completion]] = {}
    for index, (prompt, p) in enumerate(zip(prompts, all_params, strict=True)):
        engine.add_request(f"r{index}", prompt, p)
        results[f"r{index}"] = [Completion() for _ in range(p.n)]
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.sequences:
                completion = results[output.request_id][delta.index]
                completion.token_ids.extend(delta.token_ids)
                completion.text += delta.text
                if delta.finish_reason is not None:
                    completion.finish_reason = delta.finish_reason
        if check_integrity:
            engine.check_integrity()
    assert engine.scheduler_stats().kv_usage == 0.0, "blocks still held after every request finished"
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture
def engines(tiny_model_dir) -> Iterator[Callable[..., LLMEngine]]:
    """make_engine on the tiny model, every engine shut down afterwards (no core process survives)."""
    made: list[LLMEngine] = []

    def make(core_mode: str = "inprocess", **overrides) -> LLMEngine:
        if core_mode.endswith("+async"):  # asynchronous scheduling, forced on for the CPU
            core_mode = core_mode.removesuffix("+async")
            overrides.setdefault("async_scheduling", "on")
        made.append(make_engine(tiny_model_dir, core_mode, **overrides))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


class HFReference:
    """HF transformers' greedy `generate` on the same checkpoint (float32, CPU)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, **generate_kwargs: Any) -> list[int]:
        """The generated token ids; `generate_kwargs` go to `generate` (e.g. bad_words_ids)."""
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **generate_kwargs,
            )
        return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir) -> HFReference:
    return HFReference(tiny_model_dir)
