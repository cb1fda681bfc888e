"""LoRA adapters on the tiny model (float32, CPU): greedy tokens equal HF transformers + PEFT with
the same adapter file, token for token, alone and in batches that mix the base model and several
adapters; the prefix cache never hands one adapter's KV to another; a session keeps its adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_llm.config import LoRAConfig
from paged_llm.core.sessions import SessionTurn
from paged_llm.errors import InvalidRequestError
from paged_llm.lora.random_adapter import write_random_adapter
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_output_params import StructuredOutputParams
from tests.integration.conftest import run_to_completion

MAX_TOKENS = 16


def greedy(lora_name: str | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, lora_name=lora_name)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Three adapters unlike each other: every projection at rank 8; q/v only at rank 4 with
    rsLoRA; rank 16 with an alpha_pattern for the MLP's down projection."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": write_random_adapter(tiny_model_dir, root / "all8", rank=8, seed=1),
        "qv4": write_random_adapter(
            tiny_model_dir, root / "qv4", rank=4, seed=2, target_modules=("q_proj", "v_proj"), use_rslora=True
        ),
        "mix16": write_random_adapter(
            tiny_model_dir,
            root / "mix16",
            rank=16,
            seed=3,
            extra_config={"alpha_pattern": {"down_proj": 4.0}},
        ),
    }


def lora_config(adapters: dict[str, Path], **fields) -> LoRAConfig:
    return LoRAConfig(lora_modules=" ".join(f"{name}={path}" for name, path in adapters.items()), **fields)


@pytest.fixture(scope="module")
def peft_reference(tiny_model_dir, adapters):
    """name (None: the base model) -> greedy tokens of HF transformers (+ PEFT) for a prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(adapter: Path | None):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
        return model if adapter is None else PeftModel.from_pretrained(model, str(adapter)).eval()

    models = {None: load(None), **{name: load(path) for name, path in adapters.items()}}

    def greedy_tokens(name: str | None, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = models[name].generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
            )
        return out[0, ids.shape[1] :].tolist()

    return greedy_tokens


def token_ids(results) -> list[list[int]]:
    return [completions[0].token_ids for completions in results]


NAMES = [None, "all8", "qv4", "mix16"]


def test_each_adapter_alone_matches_peft(engines, adapters, peft_reference, prompts):
    engine = engines(lora=lora_config(adapters))
    prompt = prompts[3]
    outputs = {name: token_ids(run_to_completion(engine, [prompt], greedy(name)))[0] for name in NAMES}
    for name in NAMES:
        assert outputs[name] == peft_reference(name, prompt), name
    assert len({tuple(tokens) for tokens in outputs.values()}) == len(NAMES)  # each adapter matters


@pytest.mark.parametrize("core_mode", ["inprocess", "process+async"])
def test_a_batch_mixing_base_and_three_adapters_gives_each_its_alone_tokens(
    engines, adapters, peft_reference, prompts, core_mode
):
    engine = engines(core_mode, lora=lora_config(adapters))
    cases = [(prompts[i % len(prompts)], NAMES[i % len(NAMES)]) for i in range(12)]
    got = token_ids(run_to_completion(engine, [p for p, _ in cases], [greedy(n) for _, n in cases]))
    assert got == [peft_reference(name, prompt) for prompt, name in cases]


def test_the_triton_kernels_give_every_row_its_peft_tokens(engines, adapters, peft_reference, prompts):
    """The path CUDA takes (lora/kernels.py, run on CPU by the Triton interpreter that
    tests/conftest.py turns on without a GPU), with the step's tiles as ModelRunner builds them:
    mixed base and adapter rows, prefill and decode, two slots for three adapters."""
    from paged_llm.lora.manager import LoRAManager
    from paged_llm.runner import model_runner

    made = []

    def with_kernels(*args, **kwargs):
        made.append(LoRAManager(*args, **{**kwargs, "use_kernels": True}))
        return made[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "LoRAManager", with_kernels)
        engine = engines(lora=lora_config(adapters, max_loras=2))
    assert made and made[0].slots.uses_kernels
    cases = [(prompts[i % len(prompts)], NAMES[i % len(NAMES)]) for i in range(8)]
    got = token_ids(run_to_completion(engine, [p for p, _ in cases], [greedy(n, 6) for _, n in cases]))
    assert got == [peft_reference(name, prompt, 6) for prompt, name in cases]


def test_fewer_slots_than_adapters_swaps_them_and_keeps_the_tokens(
    engines, adapters, peft_reference, prompts
):
    """max_loras 2: a batch of three adapters runs two at a time (the scheduler holds the third
    back), the slots reload as adapters come and go; a small KV pool adds preemption."""
    engine = engines(lora=lora_config(adapters, max_loras=2), num_blocks=60, block_size_tokens=4)
    cases = [(prompts[i], NAMES[1 + i % 3]) for i in range(9)] + [(prompts[9], None)]
    got = token_ids(run_to_completion(engine, [p for p, _ in cases], [greedy(n) for _, n in cases]))
    assert got == [peft_reference(name, prompt) for prompt, name in cases]
    assert engine.core.runner.lora.slots.num_slots == 2


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(
    engines, adapters, peft_reference, prompts
):
    engine = engines(lora=lora_config(adapters), enable_prefix_caching=True)
    prompt = max(prompts, key=len)  # several full blocks
    assert len(prompt) > 64

    def hit_tokens(name: str | None) -> tuple[list[int], int]:
        before = engine.scheduler_stats().prefix_cache_hit_tokens
        tokens = token_ids(run_to_completion(engine, [prompt], greedy(name)))[0]
        return tokens, engine.scheduler_stats().prefix_cache_hit_tokens - before

    first_all8 = hit_tokens("all8")
    assert first_all8[1] == 0
    for name in (None, "qv4", "mix16"):  # the same prompt under another adapter: nothing shared
        tokens, hits = hit_tokens(name)
        assert hits == 0 and tokens == peft_reference(name, prompt), name
    again_all8 = hit_tokens("all8")
    assert again_all8[1] > 0 and again_all8[0] == first_all8[0] == peft_reference("all8", prompt)


def test_an_unknown_adapter_is_refused_naming_lora_name(engines, adapters, prompts):
    engine = engines(lora=lora_config(adapters))
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("r", prompts[0], greedy("nope"))
    assert error.value.field == "lora_name" and "'nope' is not loaded" in str(error.value)
    assert "'all8'" in str(error.value)


def test_a_server_without_adapters_refuses_a_lora_name(engines, prompts):
    with pytest.raises(InvalidRequestError) as error:
        engines().add_request("r", prompts[0], greedy("all8"))
    assert error.value.field == "lora_name" and "(loaded: none)" in str(error.value)


def test_a_session_keeps_its_first_turns_adapter(engines, adapters, peft_reference, prompts):
    engine = engines(lora=lora_config(adapters))
    first = prompts[2]

    def turn(request_id: str, prompt: list[int], name: str | None, start: bool = False) -> list[int]:
        engine.add_request(request_id, prompt, greedy(name), session=SessionTurn("s", start=start))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                for delta in output.sequences:
                    tokens.extend(delta.token_ids)
        return tokens

    one = turn("t1", first, "qv4", start=True)
    assert one == peft_reference("qv4", first)
    second = prompts[5]
    two = turn("t2", second, "qv4")
    assert two == peft_reference("qv4", [*first, *one, *second])
    with pytest.raises(InvalidRequestError) as error:
        turn("t3", second, "all8")
    assert error.value.field == "lora_name" and "runs with LoRA adapter 'qv4'" in str(error.value)


def test_ngram_speculation_with_adapters_keeps_their_tokens(engines, adapters, peft_reference, prompts):
    """Proposals are verified by the target model with the row's adapter: the output is the
    adapter's own greedy output, and proposals are accepted (repetitive prompts)."""
    from paged_llm.config import SpeculativeConfig

    engine = engines(lora=lora_config(adapters), speculative=SpeculativeConfig(num_speculative_tokens=3))
    repetitive = [list(prompts[4][:12]) * 4, [7, 8, 9] * 10]
    cases = [(prompt, name) for prompt in repetitive for name in NAMES]
    got = token_ids(run_to_completion(engine, [p for p, _ in cases], [greedy(n, 24) for _, n in cases]))
    assert got == [peft_reference(name, prompt, 24) for prompt, name in cases]
    assert engine.scheduler_stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
def test_tensor_parallel_ranks_shard_the_adapters_and_keep_the_tokens(
    engines, adapters, peft_reference, prompts, tensor_parallel_size
):
    """2 ranks split the KV heads, 4 replicate them (the tiny model has 2); max_loras 2 makes rank 0
    reload slots mid-run, which the other ranks replay."""
    engine = engines(lora=lora_config(adapters, max_loras=2), tensor_parallel_size=tensor_parallel_size)
    cases = [(prompts[i], NAMES[i % 4]) for i in range(8)]
    got = token_ids(run_to_completion(engine, [p for p, _ in cases], [greedy(n) for _, n in cases]))
    assert got == [peft_reference(name, prompt) for prompt, name in cases]
    assert engine.scheduler_stats().lora_evictions_total > 0


@pytest.mark.parametrize("core_mode", ["inprocess", "process+async"])
def test_adapters_loaded_and_unloaded_while_serving_lose_no_request(
    engines, adapters, peft_reference, prompts, core_mode
):
    engine = engines(
        core_mode, lora=LoRAConfig(allow_runtime_lora_updates=True, max_loras=2, max_lora_rank=16)
    )
    with pytest.raises(InvalidRequestError, match="'all8' is not loaded"):
        engine.add_request("early", prompts[0], greedy("all8"))
    engine.load_lora_adapter("all8", str(adapters["all8"]))
    cases = {f"r{i}": (prompts[i], "all8" if i % 2 else None) for i in range(6)}
    for request_id, (prompt, name) in cases.items():
        engine.add_request(request_id, prompt, greedy(name))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in cases}
    finished: set[str] = set()

    def step() -> None:
        for output in engine.step():
            for delta in output.sequences:
                tokens[output.request_id].extend(delta.token_ids)
            if output.finished:
                assert output.request_id not in finished and output.error is None
                finished.add(output.request_id)

    for _ in range(3):
        step()
    assert not finished
    engine.unload_lora_adapter("all8")  # three of its requests are running
    with pytest.raises(InvalidRequestError, match="'all8' is not loaded"):
        engine.add_request("late", prompts[0], greedy("all8"))
    engine.load_lora_adapter("qv4", str(adapters["qv4"]))  # under load too
    cases["q"] = (prompts[7], "qv4")
    tokens["q"] = []
    engine.add_request("q", *cases["q"][:1], greedy("qv4"))
    while engine.has_unfinished_requests():
        step()
    assert finished == set(cases)  # one final each, nothing lost
    assert tokens == {
        request_id: peft_reference(name, prompt) for request_id, (prompt, name) in cases.items()
    }
    assert engine.scheduler_stats().kv_usage == 0.0
    engine.load_lora_adapter("all8", str(adapters["all8"]))  # forgotten once its requests ended
    assert token_ids(run_to_completion(engine, [prompts[1]], greedy("all8"))) == [
        peft_reference("all8", prompts[1])
    ]
    assert engine.stats.snapshot().num_requests_by_lora == {"all8": 4, "qv4": 1}  # by adapter


def test_runtime_loading_refuses_what_it_cannot_serve(engines, adapters, tmp_path):
    fixed = engines(lora=lora_config({"all8": adapters["all8"]}))
    with pytest.raises(InvalidRequestError, match="allow_runtime_lora_updates is off"):
        fixed.load_lora_adapter("qv4", str(adapters["qv4"]))
    engine = engines(lora=LoRAConfig(allow_runtime_lora_updates=True, max_lora_rank=8))
    with pytest.raises(InvalidRequestError, match="rank 16, over max_lora_rank 8") as error:
        engine.load_lora_adapter("mix16", str(adapters["mix16"]))
    assert error.value.field == "lora_path"
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        engine.load_lora_adapter("none", str(tmp_path))
    engine.load_lora_adapter("qv4", str(adapters["qv4"]))
    with pytest.raises(InvalidRequestError, match="'qv4' is loaded already"):
        engine.load_lora_adapter("qv4", str(adapters["qv4"]))
    with pytest.raises(InvalidRequestError, match="'all8' is not loaded"):
        engine.unload_lora_adapter("all8")


def test_a_name_loaded_again_with_other_weights_finds_none_of_the_old_kv(
    engines, adapters, peft_reference, prompts
):
    """The prefix cache and a session hold KV computed with the first adapter of a name; after an
    unload and a load of other weights under that name, both are recomputed, while the base
    model's cached blocks stay cached through the unload."""
    engine = engines(
        lora=LoRAConfig(allow_runtime_lora_updates=True, max_lora_rank=8), enable_prefix_caching=True
    )
    prompt = max(prompts, key=len)
    engine.load_lora_adapter("x", str(adapters["all8"]))
    assert token_ids(run_to_completion(engine, [prompt], greedy("x"))) == [peft_reference("all8", prompt)]
    assert token_ids(run_to_completion(engine, [prompt], greedy(None))) == [peft_reference(None, prompt)]
    engine.add_request("s1", prompts[2], greedy("x"), session=SessionTurn("s", start=True))
    while engine.has_unfinished_requests():
        engine.step()

    def hit_tokens(name: str | None) -> int:
        before = engine.scheduler_stats().prefix_cache_hit_tokens
        engine.add_request(f"h{name}", prompt, greedy(name))
        tokens = []
        while engine.has_unfinished_requests():  # (the session holds blocks: no run_to_completion)
            for output in engine.step():
                tokens.extend(t for delta in output.sequences for t in delta.token_ids)
        assert tokens == peft_reference("qv4" if name else None, prompt)
        return engine.scheduler_stats().prefix_cache_hit_tokens - before

    engine.unload_lora_adapter("x")
    engine.load_lora_adapter("x", str(adapters["qv4"]))
    assert hit_tokens("x") == 0  # none of the first weights' blocks
    assert engine.core.sessions.get("s").num_kv_tokens == 0
    assert hit_tokens(None) >= 64  # the base model's blocks survived the unload
    engine.check_integrity()


def test_unloading_an_adapter_whose_request_waits_for_its_grammar(engines, adapters, prompts):
    """A request parked while its grammar compiles holds its adapter: the unload waits for it."""
    engine = engines(lora=LoRAConfig(allow_runtime_lora_updates=True, max_lora_rank=8))
    engine.load_lora_adapter("x", str(adapters["all8"]))
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        lora_name="x",
        structured_outputs=StructuredOutputParams(kind="regex", spec="(yes|no)"),
    )
    engine.add_request("r", prompts[0], constrained)
    record = engine.core.requests.get(engine.processor.core_request_id("r"))
    assert record.parked is not None  # its grammar compiles on a worker
    engine.unload_lora_adapter("x")
    assert "x" in engine.core.runner.lora.names  # still used
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [final] = [o for o in outputs if o.finished]
    assert final.error is None and "x" not in engine.core.runner.lora.names
    text = "".join(d.text for o in outputs for d in o.sequences)
    assert text in ("yes", "no")


def test_runtime_loads_keep_every_adapter_in_host_memory_by_default(tiny_model_dir, adapters):
    from paged_llm.lora.manager import LoRAManager
    from paged_llm.models.hf_config import load_model_spec

    config = LoRAConfig(allow_runtime_lora_updates=True, max_loras=1, max_lora_rank=16)
    manager = LoRAManager(config, load_model_spec(tiny_model_dir), torch.float32, torch.device("cpu"))
    for name in ("all8", "qv4"):
        manager.add(name, adapters[name])
    assert list(manager.adapters) == ["all8", "qv4"] and manager.max_cpu_loras is None


@pytest.mark.parametrize("layout", ["fp8-channel", "fp8-block"])
def test_adapters_over_fp8_base_weights_match_peft_over_the_dequantized_model(tmp_path, prompts, layout):
    """An FP8 checkpoint (dequantized at load on CPU; kept FP8 on CUDA, where the update is added to
    the FP8 projection's output the same way): the adapter's tokens equal HF + PEFT over the
    checkpoint's dequantized weights with the same adapter file."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from paged_llm.models.random_model import write_random_model
    from tests.integration.conftest import make_engine
    from tests.integration.test_fp8_checkpoints import _dequantized_twin

    fp8_dir = write_random_model(
        tmp_path / layout, "tiny-llama", "bfloat16", seed=5, quantization=layout, std=0.05
    )
    twin = _dequantized_twin(fp8_dir, tmp_path / "twin")
    adapter = write_random_adapter(twin, tmp_path / "adapter", rank=8, seed=4)
    chosen = prompts[:3]
    engine = make_engine(fp8_dir, lora=LoRAConfig(lora_modules=f"tuned={adapter}"))
    try:
        got = token_ids(run_to_completion(engine, chosen, greedy("tuned", 10)))
        base = token_ids(run_to_completion(engine, chosen, greedy(None, 10)))
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(model, str(adapter)).eval()
    expected = []
    with torch.no_grad():
        for prompt in chosen:
            ids = torch.tensor([prompt])
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False
            )
            expected.append(out[0, ids.shape[1] :].tolist())
    assert got == expected
    assert got != base  # the adapter changes the tokens: the test can tell
