"""FP8 checkpoints in the published layouts (random weights written in exactly those layouts,
models/random_model.py), dequantized at load on CPU: greedy tokens equal HF transformers' float64
forward over the same dequantized weights; wrong layouts are refused naming the tensor or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_llm.config import ConfigError
from paged_llm.models.random_model import write_random_model
from paged_llm.sampling_params import SamplingParams
from tests.integration.conftest import make_engine, run_to_completion

NUM_TOKENS = 10


def _dequantized_twin(fp8_dir: Path, out_dir: Path) -> Path:
    """The checkpoint with every FP8 projection replaced by its float32 values (HF transformers'
    own dequantization for blocks; weight x scale for compressed-tensors) and no quantization."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((fp8_dir / "config.json").read_text())
    quant = config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(fp8_dir / name, out_dir / name)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale_inv", "weight_scale", "input_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            module = name[: -len(".weight")]
            if quant["quant_method"] == "fp8":  # this transformers' private helper (not every version)
                from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

                block = quant["weight_block_size"]
                scale = tensors[f"{module}.weight_scale_inv"].float()
                tensor = _dequantize_fp8_weight(tensor, scale, block, torch.float32)
            else:
                tensor = tensor.float() * tensors[f"{module}.weight_scale"].float()
        out[name] = tensor.float()
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _hf_greedy_float64(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False
            )
            outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def _engine_greedy(model_dir: Path, prompts: list[list[int]], **overrides) -> list[list[int]]:
    engine = make_engine(model_dir, **overrides)
    try:  # shut down: a tensor-parallel engine is one per process
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        return [r[0].token_ids for r in run_to_completion(engine, prompts, params)]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> dict[str, Path]:
    """tiny-llama in each layout (bfloat16 scales, as the published checkpoints have them);
    fp8-block with 128x128 blocks, i.e. one partial block a projection, as Qwen3-*-FP8 writes."""
    root = tmp_path_factory.mktemp("fp8")
    return {
        layout: write_random_model(
            root / layout, "tiny-llama", "bfloat16", seed=5, quantization=layout, std=0.05
        )
        for layout in ("fp8-block", "fp8-channel", "fp8-tensor")
    }


# (scale tensor, its shape for a [out, in] weight, static input scale) as the published layouts write them
EXPECTED_TENSORS = {
    "fp8-block": ("weight_scale_inv", lambda out, inp: ((out + 127) // 128, (inp + 127) // 128), False),
    "fp8-channel": ("weight_scale", lambda out, inp: (out, 1), False),
    "fp8-tensor": ("weight_scale", lambda out, inp: (1,), True),
}


@pytest.mark.parametrize("layout", sorted(EXPECTED_TENSORS))
def test_random_checkpoints_have_the_published_names_dtypes_and_shapes(fp8_models, layout):
    from safetensors import safe_open

    scale_suffix, scale_shape, has_input_scale = EXPECTED_TENSORS[layout]
    handle = safe_open(str(fp8_models[layout] / "model.safetensors"), "pt")
    names = set(handle.keys())
    projections = [n for n in names if n.endswith("_proj.weight")]
    assert len(projections) == 2 * 7
    for name in projections:
        weight = handle.get_slice(name)
        module = name.removesuffix(".weight")
        scale = handle.get_slice(f"{module}.{scale_suffix}")
        assert weight.get_dtype() == "F8_E4M3" and scale.get_dtype() == "BF16"
        assert tuple(scale.get_shape()) == scale_shape(*weight.get_shape())
        assert (f"{module}.input_scale" in names) == has_input_scale
    others = names - set(projections) - {n for n in names if n.endswith(("_scale", "_scale_inv"))}
    assert {handle.get_slice(n).get_dtype() for n in others} == {"BF16"}  # embeddings, norms, lm_head
    config = json.loads((fp8_models[layout] / "config.json").read_text())["quantization_config"]
    if layout == "fp8-block":  # Qwen3-*-FP8's four keys
        assert config == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}  # fmt: skip
    else:
        assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-channel", "fp8-tensor"])
def test_each_layout_gives_the_tokens_of_its_dequantized_weights(fp8_models, layout, prompts, tmp_path):
    model_dir = fp8_models[layout]
    header = load_file(str(model_dir / "model.safetensors"))
    assert header["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert header["model.embed_tokens.weight"].dtype == torch.bfloat16  # not a projection: unquantized
    chosen = prompts[:4]
    expected = _hf_greedy_float64(_dequantized_twin(model_dir, tmp_path / "twin"), chosen)
    assert _engine_greedy(model_dir, chosen) == expected


@pytest.mark.parametrize("layout", ["fp8-channel", "fp8-tensor", "online", "fp8-block"])
def test_weights_kept_in_fp8_give_the_dequantized_tokens(fp8_models, layout, prompts, tmp_path, monkeypatch):
    """Projections kept in FP8 with a scale a row, or a scale a row and 128 columns for 128 x 128
    blocks (what CUDA sm90 does; forced here, where the layer dequantizes for each call) give the
    tokens of the weights dequantized at load, and hold FP8 bytes and float32 scales."""
    from paged_llm.models.decoder import projections

    if layout == "online":
        model_dir = write_random_model(tmp_path / "bf16", "tiny-llama", "bfloat16", seed=7, std=0.05)
        overrides = {"quantization": "fp8"}
    else:
        model_dir, overrides = fp8_models[layout], {}
    chosen = prompts[:4]
    dequantized = _engine_greedy(model_dir, chosen, **overrides)
    monkeypatch.setenv("PAGED_LLM_FP8_WEIGHTS", "keep")
    engine = make_engine(model_dir, **overrides)
    try:
        model = engine.core.runner.model
        kept = list(projections(model))
        assert len(kept) == 4 * model.spec.num_layers
        for _, linear in kept:
            assert linear.weight.dtype == torch.float8_e4m3fn
            assert linear.weight_scale.dtype == torch.float32
            rows, columns = linear.weight.shape
            expected = (rows, (columns + 127) // 128) if layout == "fp8-block" else (rows,)
            assert linear.weight_scale.shape == expected
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        assert [r[0].token_ids for r in run_to_completion(engine, chosen, params)] == dequantized
    finally:
        engine.shutdown()


@pytest.mark.parametrize("layout", ["fp8-channel", "fp8-tensor", "fp8-block"])
def test_weights_kept_in_fp8_split_over_two_ranks(fp8_models, layout, prompts, monkeypatch):
    """Tensor parallelism with kept FP8 projections: each rank holds its rows of q/k/v and gate/up
    with their row scales, and all rows (its columns) of o and down: the tokens of one rank.
    128 x 128 blocks whose columns the ranks split inside a block (tiny-llama's o_proj splits at
    64) are dequantized at load instead."""
    from paged_llm.models.decoder import projections

    chosen = prompts[:3]
    one_rank = _engine_greedy(fp8_models[layout], chosen)
    monkeypatch.setenv("PAGED_LLM_FP8_WEIGHTS", "keep")  # the workers inherit it
    engine = make_engine(fp8_models[layout], tensor_parallel_size=2)
    try:
        model = engine.core.runner.model  # rank 0's share
        _, qkv = next(projections(model))
        if layout == "fp8-block":
            assert qkv.weight.dtype != torch.float8_e4m3fn and "weight_scale" not in qkv._buffers
        else:
            assert qkv.weight.dtype == torch.float8_e4m3fn
            assert qkv.weight_scale.shape == (qkv.weight.shape[0],)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        assert [r[0].token_ids for r in run_to_completion(engine, chosen, params)] == one_rank
    finally:
        engine.shutdown()


def test_blocks_that_do_not_align_with_the_ranks_split(tmp_path, prompts):
    """48x80 blocks: tiny-llama's 128 q rows split into 64 per rank, inside a block; each rank
    dequantizes its slice with the whole scale grid and the tokens equal one rank's."""
    model_dir = write_random_model(
        tmp_path / "odd-blocks",
        "tiny-llama",
        "bfloat16",
        seed=6,
        quantization="fp8-block",
        fp8_block=(48, 80),
    )
    chosen = prompts[:3]
    one_rank = _engine_greedy(model_dir, chosen)
    assert one_rank == _hf_greedy_float64(_dequantized_twin(model_dir, tmp_path / "twin"), chosen)
    assert _engine_greedy(model_dir, chosen, tensor_parallel_size=2) == one_rank


def test_quantization_fp8_on_an_unquantized_checkpoint(tmp_path, prompts):
    """Per-channel at load: the tokens of weights rounded to FP8 that way (an independent quantizer
    here), which differ from the unquantized checkpoint's."""
    model_dir = write_random_model(tmp_path / "bf16", "tiny-llama", "bfloat16", seed=7, std=0.05)
    twin = tmp_path / "twin"
    twin.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(model_dir / name, twin / name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, tensor in tensors.items():
        if name.startswith("model.layers.") and name.split(".")[-2] in projections:
            values = tensor.float()
            amax = values.abs().amax(dim=1, keepdim=True)
            scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            tensors[name] = (values / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    save_file({k: v.float() for k, v in tensors.items()}, str(twin / "model.safetensors"))
    chosen = prompts[:3]
    quantized = _engine_greedy(model_dir, chosen, quantization="fp8")
    assert quantized == _hf_greedy_float64(twin, chosen)
    assert quantized != _engine_greedy(model_dir, chosen)  # the rounding shows: the test can tell


def _rewrite(model_dir: Path, out_dir: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(model_dir, out_dir)
    if edit_tensors is not None:
        tensors = load_file(str(out_dir / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((out_dir / "config.json").read_text())
        edit_config(config)
        (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def _drop_scale(tensors):
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]


def _fp8_embeddings(tensors):
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.float8_e4m3fn)


def _orphan_scale(tensors):
    del tensors["model.layers.0.mlp.up_proj.weight"]


def _other_block_size(config):
    config["quantization_config"]["weight_block_size"] = [64, 64]


def _no_quantization_config(config):
    del config["quantization_config"]


def _unknown_architecture(config):
    config["architectures"] = ["DeepseekV3ForCausalLM"]


@pytest.mark.parametrize(
    ("edit_tensors", "edit_config", "message"),
    [
        (_drop_scale, None, "model.layers.1.self_attn.o_proj.weight is FP8, but its scale "
         "model.layers.1.self_attn.o_proj.weight_scale_inv is missing"),
        (_fp8_embeddings, None, "model.embed_tokens.weight is torch.float8_e4m3fn: only the decoder"),
        (_orphan_scale, None, "model.layers.0.mlp.up_proj.weight_scale_inv scales "
         "model.layers.0.mlp.up_proj.weight, which is missing"),
        (None, _other_block_size, r"model.layers.0.mlp.down_proj.weight_scale_inv has shape \(1, 2\); "
         r"fp8-block \(blocks of 64x64\) needs \(2, 4\) for a weight of shape \(128, 256\)"),
        (None, _no_quantization_config, "is torch.float8_e4m3fn, but config.json has no quantization_config"),
        (None, _unknown_architecture, "unsupported architecture \\['DeepseekV3ForCausalLM'\\]"),
    ],
)  # fmt: skip
def test_wrong_layouts_are_refused_naming_the_tensor_or_field(
    fp8_models, tmp_path, edit_tensors, edit_config, message
):
    model_dir = _rewrite(fp8_models["fp8-block"], tmp_path / "bad", edit_tensors, edit_config)
    with pytest.raises(ConfigError, match=message):
        make_engine(model_dir)


def _add_kv_scales(tensors):
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.5], dtype=torch.bfloat16)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([2.0], dtype=torch.bfloat16)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(
        0.25, dtype=torch.bfloat16
    )  # older: one for both


@pytest.mark.parametrize("fp8_kv_cache", [True, False])
def test_kv_cache_scales_are_read_for_an_fp8_cache_only(fp8_models, tmp_path, fp8_kv_cache):
    from paged_llm.layers.attention.portable import PortableAttention
    from paged_llm.models.hf_config import load_model_spec
    from paged_llm.models.loader import load_model

    model_dir = _rewrite(fp8_models["fp8-channel"], tmp_path / "kv-scales", _add_kv_scales)
    spec = load_model_spec(model_dir)
    model = load_model(
        model_dir,
        spec,
        PortableAttention(),
        64,
        torch.device("cpu"),
        torch.float32,
        False,
        fp8_kv_cache=fp8_kv_cache,
    )
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.layers]
    assert scales == ([(0.5, 2.0), (0.25, 0.25)] if fp8_kv_cache else [(1.0, 1.0), (1.0, 1.0)])


def test_a_kv_cache_scale_must_be_one_positive_value(fp8_models, tmp_path):
    def bad(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)

    model_dir = _rewrite(fp8_models["fp8-channel"], tmp_path / "bad-kv-scale", bad)
    with pytest.raises(
        ConfigError, match=r"model.layers.0.self_attn.k_scale has shape \(2,\); a KV cache scale"
    ):
        make_engine(model_dir, kv_cache_dtype="fp8")


def test_quantization_fp8_does_not_guess_an_fp8_checkpoints_scales(fp8_models, tmp_path):
    """FP8 weights with no quantization_config are refused with quantization fp8 too (which
    quantizes unquantized weights), not read as per-channel."""
    model_dir = _rewrite(fp8_models["fp8-channel"], tmp_path / "no-config", None, _no_quantization_config)
    with pytest.raises(
        ConfigError, match=r"is torch\.float8_e4m3fn, but config\.json has no quantization_config"
    ):
        make_engine(model_dir, quantization="fp8")
