"""LoRA without a forward: reading PEFT checkpoints and refusing what cannot be served (each
refusal names its field or tensor), the lora_modules setting, a step's rows grouped by slot, the
slots' least-recently-used reuse, the scheduler's cap on adapters per batch, the prefix-cache
hash roots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_llm.config import ConfigError, EngineConfig, LoRAConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError, load_adapter
from paged_llm.lora.manager import LoRAManager
from paged_llm.lora.random_adapter import write_random_adapter
from paged_llm.lora.slots import NO_ADAPTER, LoRASlots
from paged_llm.models.hf_config import load_model_spec
from paged_llm.sampling_params import SamplingParams
from paged_llm.sequence import Sequence, SequenceStatus
from tests.unit.test_scheduler import make_scheduler, make_sequence


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return load_model_spec(tiny_model_dir)


def written(tiny_model_dir: Path, tmp_path: Path, name: str = "a", **kwargs) -> Path:
    return write_random_adapter(tiny_model_dir, tmp_path / name, rank=kwargs.pop("rank", 4), **kwargs)


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(fields)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


def refusal(path: Path, spec, max_lora_rank: int = 64) -> str:
    with pytest.raises(LoRAAdapterError) as error:
        load_adapter("a", path, spec, max_lora_rank)
    return str(error.value)


def test_a_written_adapter_loads_with_peft_scaling(tiny_model_dir, tmp_path, spec):
    path = written(tiny_model_dir, tmp_path, rank=4, lora_alpha=16, use_rslora=True)
    edit_config(path, alpha_pattern={"down_proj": 2})
    adapter = load_adapter("a", path, spec, 64)
    assert adapter.max_rank == 4 and len(adapter.modules) == 7 * spec.num_layers
    assert adapter.modules[(0, "q_proj")].scaling == pytest.approx(16 / math.sqrt(4))
    assert adapter.modules[(1, "down_proj")].scaling == pytest.approx(2 / math.sqrt(4))
    assert adapter.modules[(0, "q_proj")].a.shape == (4, spec.hidden_size)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
        ({"lora_alpha": 0}, "lora_alpha"),
    ],
)
def test_config_fields_that_cannot_be_served_are_named(tiny_model_dir, tmp_path, spec, fields, named):
    path = written(tiny_model_dir, tmp_path)
    edit_config(path, **fields)
    message = refusal(path, spec)
    assert f"{CONFIG_FILE}: {named} " in message, message


def test_a_rank_over_the_cap_is_named(tiny_model_dir, tmp_path, spec):
    message = refusal(written(tiny_model_dir, tmp_path, rank=8), spec, max_lora_rank=4)
    assert "layers.0.mlp.down_proj has rank 8, over max_lora_rank 4" in message


def test_an_adapter_of_another_base_model_is_named(tiny_model_dir, tmp_path, spec):
    path = written(tiny_model_dir, tmp_path)

    def widen(tensors):
        name = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        tensors[name] = torch.zeros(4, spec.intermediate_size * 2)

    edit_tensors(path, widen)
    message = refusal(path, spec)
    assert "layers.1.mlp.down_proj.lora_A.weight [4, 256]" in message and "another base model" in message


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (
            lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"),
            "up_proj.lora_B.weight",
        ),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)),
            "'base_model.model.lm_head.lora_A.weight'",
        ),
        (
            lambda t: t.__setitem__(
                "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64)
            ),
            "layer 5; the base model has 2 layers",
        ),
    ],
)
def test_tensors_that_cannot_be_served_are_named(tiny_model_dir, tmp_path, spec, edit, named):
    path = written(tiny_model_dir, tmp_path)
    edit_tensors(path, edit)
    message = refusal(path, spec)
    assert named in message, message


def test_a_directory_without_a_checkpoint_is_named(tmp_path, spec):
    assert f"no {CONFIG_FILE}" in refusal(tmp_path, spec)


def test_lora_modules_setting():
    config = EngineConfig.from_parameters({"lora_modules": "a=/x, b=/y", "max_loras": "2"}).lora
    assert config.modules() == {"a": "/x", "b": "/y"} and config.max_loras == 2 and config.enabled
    assert not LoRAConfig().enabled
    for bad, named in [("a", "not NAME=PATH"), ("a=/x a=/y", "given twice"), ("=/x", "not NAME=PATH")]:
        with pytest.raises(ConfigError, match=named):
            LoRAConfig(lora_modules=bad)
    with pytest.raises(ConfigError, match="max_loras"):
        LoRAConfig(max_loras=0)


def test_lora_name_in_sampling_parameters():
    assert SamplingParams.from_mapping({"lora_name": "a"}).lora_name == "a"
    assert SamplingParams.from_mapping({"lora_name": ""}).lora_name is None  # vllm_backend's default
    assert SamplingParams.from_mapping({"lora_name": None}).lora_name is None
    with pytest.raises(ValueError, match="lora_name"):
        SamplingParams.from_mapping({"lora_name": 3})


def test_a_steps_rows_are_grouped_by_slot(spec):
    slots = LoRASlots(spec, num_slots=3, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    slots.set_step([(NO_ADAPTER, 5), (1, 1), (1, 1), (0, 3), (NO_ADAPTER, 1), (1, 2), (2, 1)])
    step = {item.slot: item.rows for item in slots._step}
    assert step[0] == slice(7, 10) and step[2] == slice(13, 14)
    assert step[1].tolist() == [5, 6, 11, 12]  # two runs of rows: gathered
    slots.set_step([(NO_ADAPTER, 4)])
    assert not slots.active


def test_the_update_is_the_adapters_low_rank_product(tiny_model_dir, tmp_path, spec):
    adapter = load_adapter("a", written(tiny_model_dir, tmp_path, rank=4), spec, 8)
    slots = LoRASlots(spec, num_slots=2, max_rank=8, dtype=torch.float64, device=torch.device("cpu"))
    slots.load(1, adapter)
    x = torch.randn(3, spec.hidden_size, dtype=torch.float64)
    slots.set_step([(NO_ADAPTER, 1), (1, 2)])
    out = slots.add("qkv_proj", 0, x, torch.zeros(3, slots.b["qkv_proj"][0].shape[1], dtype=torch.float64))
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim
    for module, start, size in [
        ("q_proj", 0, q_size),
        ("k_proj", q_size, kv_size),
        ("v_proj", q_size + kv_size, kv_size),
    ]:
        lora = adapter.modules[(0, module)]
        want = (x[1:] @ lora.a.double().T) @ lora.b.double().T * lora.scaling
        torch.testing.assert_close(out[1:, start : start + size], want, msg=module)
    assert torch.count_nonzero(out[0]) == 0  # the base row is left alone


def test_slots_are_reused_least_recently_used_first(tiny_model_dir, tmp_path, spec):
    paths = {name: written(tiny_model_dir, tmp_path, name, seed=i) for i, name in enumerate("abc")}
    config = LoRAConfig(lora_modules=" ".join(f"{n}={p}" for n, p in paths.items()), max_loras=2)
    manager = LoRAManager(config, spec, torch.float32, torch.device("cpu"))

    def step(*names: str | None) -> list[str | None]:
        rows = [_Row(_seq(name)) for name in names]
        manager.prepare_step(rows)
        return list(manager.slots.adapter_in_slot)

    assert step("a", "b") == ["a", "b"]
    assert step("b", None) == ["a", "b"]
    assert step("c") == ["c", "b"]  # a was used longest ago
    assert step("a", "c") == ["c", "a"]
    assert (manager.num_loads, manager.num_evictions, manager.num_slots_used) == (4, 2, 2)
    with pytest.raises(RuntimeError, match="more adapters in one step"):
        step("a", "b", "c")


class _Row:
    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.num_new_tokens = 1


def _seq(lora_name: str | None) -> Sequence:
    return Sequence("s", [1, 2], SamplingParams(lora_name=lora_name), seed=0)


def test_the_scheduler_keeps_a_batch_within_max_loras():
    scheduler = make_scheduler()
    scheduler.max_loras = 2
    for index, name in enumerate(["a", "b", None, "c", "a", None]):
        scheduler.add_sequence(make_sequence(f"s{index}", 3, lora_name=name))
    output = scheduler.schedule()
    # c waits for a slot; the a behind it waits too (the running adapters drain), the base-model
    # sequence behind them goes on
    assert [item.seq_id for item in output.scheduled] == ["s0", "s1", "s2", "s5"]
    for seq_id in ("s0", "s1"):
        scheduler.finish_sequences([seq_id], SequenceStatus.FINISHED_STOPPED)
    assert {"s3", "s4"} <= {item.seq_id for item in scheduler.schedule().scheduled}  # a and b ended


def test_an_adapter_that_cannot_run_preempts_nothing():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.max_loras = 1
    for index in range(2):
        scheduler.add_sequence(make_sequence(f"a{index}", 3, lora_name="a", priority=5))
    scheduler.schedule()
    scheduler.add_sequence(make_sequence("x", 3, lora_name="c", priority=0))
    output = scheduler.schedule()
    assert not output.preempted and {s.seq_id for s in scheduler.running} == {"a0", "a1"}


def test_each_adapter_has_its_own_prefix_hashes():
    kv = KVCacheManager(16, 4)
    hashes = {}
    for name in (None, "a", "b"):
        seq = Sequence(f"s{name}", list(range(8)), SamplingParams(lora_name=name), seed=0)
        kv.update_block_hashes(seq)
        hashes[name] = seq.block_hashes
    assert len({tuple(h) for h in hashes.values()}) == 3 and all(len(h) == 2 for h in hashes.values())


def test_vllm_backends_multi_lora_json_adds_adapters(tmp_path, monkeypatch):
    version_dir = tmp_path / "llm" / "1"
    version_dir.mkdir(parents=True)
    (tmp_path / "cwd_adapter").mkdir()
    monkeypatch.chdir(tmp_path)
    config = LoRAConfig(lora_modules="a=/x")
    assert config.with_multi_lora_json(version_dir) is config  # no file: unchanged
    (version_dir / "multi_lora.json").write_text(
        json.dumps({"b": "cwd_adapter", "c": "weights/c", "d": "/abs/d"})
    )
    assert config.with_multi_lora_json(version_dir).modules() == {
        "a": "/x",
        "b": str(tmp_path / "cwd_adapter"),  # relative, found from the server's directory
        "c": str(version_dir / "weights" / "c"),  # else from the version directory
        "d": "/abs/d",
    }
    (version_dir / "multi_lora.json").write_text(json.dumps({"a": "/y"}))
    with pytest.raises(ConfigError, match="'a' is given twice"):
        config.with_multi_lora_json(version_dir)
    (version_dir / "multi_lora.json").write_text(json.dumps(["a"]))
    with pytest.raises(ConfigError, match=r"multi_lora\.json: expected an object"):
        config.with_multi_lora_json(version_dir)


def test_serve_flags_load_the_adapters_and_route_their_names(tmp_path):
    from paged_llm.cli.arguments import build_parser, engine_parameters, lora_flags
    from paged_llm.openai.server import parse_lora_adapters
    from paged_llm.openai.settings import OpenAISettings

    args = build_parser().parse_args(
        ["serve", "--lora-modules", f"a={tmp_path}/a", "b=rel/b", "--max-loras", "2"]
    )
    args.model_path = "m"
    parameters = engine_parameters(args)
    assert parameters["lora_modules"] == f"a={tmp_path}/a b={(Path.cwd() / 'rel/b')}"
    assert parameters["max_loras"] == "2"
    assert lora_flags(args) == ["--lora-adapter", "a=llm", "--lora-adapter", "b=llm"]
    settings = OpenAISettings("t", lora_adapters=parse_lora_adapters(["a=llm", "b=llm"]))
    assert OpenAISettings.from_json(settings.to_json()) == settings
    assert settings.target("a") == ("llm", "a") and settings.target("llm") == ("llm", None)
    with pytest.raises(SystemExit, match="ADAPTER=MODEL"):
        parse_lora_adapters(["a"])


def test_host_memory_keeps_max_cpu_loras_adapters(tiny_model_dir, tmp_path, spec):
    paths = {name: written(tiny_model_dir, tmp_path, name, seed=i) for i, name in enumerate("abc")}
    config = LoRAConfig(
        lora_modules=" ".join(f"{n}={p}" for n, p in paths.items()), max_loras=1, max_cpu_loras=1
    )
    manager = LoRAManager(config, spec, torch.float32, torch.device("cpu"))
    assert list(manager.adapters) == ["c"] and manager.num_reads == 3  # each checked once
    manager.prepare_step([_Row(_seq("c"))])
    assert manager.num_reads == 3  # in memory
    manager.prepare_step([_Row(_seq("a"))])
    assert list(manager.adapters) == ["a"] and manager.num_reads == 4  # read again, c dropped
    assert manager.slots.adapter_in_slot == ["a"]
    two_slots = LoRAConfig(lora_modules=config.lora_modules, max_loras=2, max_cpu_loras=1)
    assert LoRAManager(two_slots, spec, torch.float32, torch.device("cpu")).max_cpu_loras == 2


def test_a_failed_read_leaves_the_slots_as_they_were(tiny_model_dir, tmp_path, spec):
    paths = {name: written(tiny_model_dir, tmp_path, name, seed=i) for i, name in enumerate("abc")}
    config = LoRAConfig(
        lora_modules=" ".join(f"{n}={p}" for n, p in paths.items()), max_loras=2, max_cpu_loras=2
    )
    manager = LoRAManager(config, spec, torch.float32, torch.device("cpu"))
    manager.prepare_step([_Row(_seq("b")), _Row(_seq("c"))])
    hidden = paths["a"].rename(tmp_path / "gone")
    with pytest.raises(LoRAAdapterError):
        manager.prepare_step([_Row(_seq("a"))])
    assert manager.slots.adapter_in_slot == ["b", "c"] and manager.num_loads == 2
    hidden.rename(paths["a"])
    manager.prepare_step([_Row(_seq("b"))])
    manager.prepare_step([_Row(_seq("a"))])
    assert manager.slots.adapter_in_slot == ["b", "a"]


def test_more_adapter_configs_that_would_be_served_wrongly_are_named(tiny_model_dir, tmp_path, spec):
    for fields, named in [
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
        ({"init_lora_weights": "olora"}, "init_lora_weights"),
        ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
    ]:
        path = written(tiny_model_dir, tmp_path / named / str(len(str(fields))))
        edit_config(path, **fields)
        assert f"{CONFIG_FILE}: {named} " in refusal(path, spec)
    path = written(tiny_model_dir, tmp_path / "dotted")
    edit_config(
        path,
        target_modules=["self_attn.q_proj", "model.layers.0.mlp.down_proj"],
        init_lora_weights="gaussian",
    )
    assert load_adapter("a", path, spec, 64).max_rank == 4  # PEFT accepts dotted names: so do we


def test_paths_that_would_split_the_adapter_list_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="has an '='"):
        LoRAConfig(lora_modules="a=/m/x=y")
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    (version_dir / "multi_lora.json").write_text(json.dumps({"a": "/my adapters/a"}))
    with pytest.raises(ConfigError, match="has a space, comma or '='"):
        LoRAConfig().with_multi_lora_json(version_dir)


def test_serve_refuses_an_adapter_named_like_the_model_and_routes_engine_arg_adapters():
    from paged_llm.cli.arguments import build_parser, lora_flags

    args = build_parser().parse_args(["serve", "--lora-modules", "llm=/x"])
    args.model_path = "m"
    with pytest.raises(SystemExit, match="served model's name"):
        lora_flags(args)
    args = build_parser().parse_args(["serve", "--engine-arg", "lora_modules=a=/x b=/y"])
    args.model_path = "m"
    assert lora_flags(args) == ["--lora-adapter", "a=llm", "--lora-adapter", "b=llm"]


def test_a_load_never_takes_the_slot_of_an_adapter_later_in_the_same_step(tiny_model_dir, tmp_path, spec):
    paths = {name: written(tiny_model_dir, tmp_path, name, seed=i) for i, name in enumerate("abc")}
    config = LoRAConfig(lora_modules=" ".join(f"{n}={p}" for n, p in paths.items()), max_loras=2)
    manager = LoRAManager(config, spec, torch.float32, torch.device("cpu"))
    manager.prepare_step([_Row(_seq("a"))])
    manager.prepare_step([_Row(_seq("b"))])
    # c comes first in the rows; a (least recently used, but in this step) keeps its slot
    manager.prepare_step([_Row(_seq("c")), _Row(_seq("a"))])
    assert manager.slots.adapter_in_slot == ["a", "c"] and manager.num_loads == 3
