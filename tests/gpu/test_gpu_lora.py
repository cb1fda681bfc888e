"""LoRA on CUDA: the adapter path's Triton kernels (lora/kernels.py) inside the decode and
mixed-step CUDA graphs captured with them, float32, against HF transformers + PEFT on the same GPU,
token for token; steps without adapter rows keep the base graphs; the graphs with adapters fit the
memory the profile set aside. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from paged_llm.config import CacheConfig, DeviceConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.lora.random_adapter import write_random_adapter
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import run_to_completion

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MAX_TOKENS = 16
NAMES = [None, "all8", "qv4", "mix16"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": write_random_adapter(tiny_model_dir, root / "all8", rank=8, seed=1),
        "qv4": write_random_adapter(
            tiny_model_dir, root / "qv4", rank=4, seed=2, target_modules=("q_proj", "v_proj"), use_rslora=True
        ),
        "mix16": write_random_adapter(tiny_model_dir, root / "mix16", rank=16, seed=3),
    }


@pytest.fixture(scope="module")
def peft_greedy(tiny_model_dir, adapters):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).cuda().eval()
        return model if path is None else peft.PeftModel.from_pretrained(model, str(path)).eval()

    models = {None: load(None), **{name: load(path) for name, path in adapters.items()}}

    def greedy(name, prompt):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = models[name].generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        return out[0, ids.shape[1] :].tolist()

    return greedy


def lora_engine(model_dir, adapters, dtype="float32", **scheduler) -> LLMEngine:
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        cache=CacheConfig(
            num_blocks=scheduler.pop("num_blocks", 1024),
            block_size_tokens=16,
        ),
        scheduler=SchedulerConfig(**scheduler),
        device=DeviceConfig(device="cuda"),
        lora=LoRAConfig(lora_modules=modules),
    )
    return LLMEngine(config, show_progress=False)


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_adapter_rows_replay_graphs_with_the_kernels_and_match_peft(
    tiny_model_dir, adapters, peft_greedy, prompts, async_scheduling
):
    with lora_engine(tiny_model_dir, adapters, max_num_seqs=32, async_scheduling=async_scheduling) as engine:
        check_adapter_and_base_steps(engine, peft_greedy, prompts)


def check_adapter_and_base_steps(engine, peft_greedy, prompts):
    runner = engine.core.runner
    assert runner.lora.slots.uses_kernels and runner.lora_graphs is not None
    cases = [(prompts[i % len(prompts)], NAMES[i % len(NAMES)]) for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, lora_name=name) for _, name in cases]
    got = [c[0].token_ids for c in run_to_completion(engine, [p for p, _ in cases], params)]
    assert got == [peft_greedy(name, prompt) for prompt, name in cases]
    assert runner.lora_graphs.num_replays > 0 and runner.lora_mixed_graphs.num_replays > 0
    # base-only steps after the adapters' requests take the graphs without the adapter path
    base_replays = runner.graphs.num_replays
    base = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    only_base = run_to_completion(engine, [prompts[0]], base)
    assert only_base[0][0].token_ids == peft_greedy(None, prompts[0])
    assert runner.graphs.num_replays > base_replays
    assert engine.scheduler_stats().kv_usage == 0.0


def test_lone_adapter_prompts_one_at_a_time_match_peft(tiny_model_dir, adapters, peft_greedy, prompts):
    with lora_engine(tiny_model_dir, adapters, max_num_seqs=8) as engine:
        for index, prompt in enumerate(prompts):
            name = NAMES[1 + index % 3]
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, lora_name=name)
            got = run_to_completion(engine, [prompt], params)[0][0].token_ids
            assert got == peft_greedy(name, prompt), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_with_adapters_fit_the_memory_the_profile_set_aside(tiny_model_dir, adapters, dtype):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    utilization = min(1.0, (total_bytes - free_bytes + (8 << 30)) / total_bytes)
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype=dtype),
        cache=CacheConfig(gpu_memory_utilization=utilization, block_size_tokens=16),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
        device=DeviceConfig(device="cuda"),
        lora=LoRAConfig(lora_modules=modules),
    )
    with LLMEngine(config, show_progress=False) as engine:
        runner = engine.core.runner
        reserve, held = runner.graph_pool_reserve_bytes, runner.graph_pool_bytes
    print(f"{dtype} with LoRA: graphs hold {held / 2**20:.0f} MiB of {reserve / 2**20:.0f} MiB set aside")
    assert reserve is not None and 0 < held <= reserve
