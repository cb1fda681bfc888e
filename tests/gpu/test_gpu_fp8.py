"""FP8 weights on CUDA: the projections kept in FP8 (FP8 GEMVs at one row, W8A8 GEMMs above) inside
the CUDA graphs, and FP8 checkpoints against HF transformers' own FP8 implementation where it runs.

Greedy tokens of FP8 arithmetic need not equal a reference token for token (W8A8 rounds the
activations; a near-tie flips), so each token we pick is checked against the reference's logits
over the same text (teacher forcing): it must be the reference's top token or within MARGIN of it.
Skipped without an sm90 GPU."""

from __future__ import annotations

import pytest
import torch

from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.models.decoder import projections
from paged_llm.models.random_model import write_random_model
from paged_llm.sampling_params import SamplingParams
from tests.gpu.test_gpu_engine import cuda_engine
from tests.integration.conftest import run_to_completion
from tests.integration.test_fp8_checkpoints import _dequantized_twin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs CUDA sm90"
    ),
]
MAX_TOKENS = 16
MARGIN = 0.25  # logits of a bf16 model over W8A8 rounding


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r[0].token_ids for r in run_to_completion(engine, prompts, params)]


def assert_reference_agrees(hf_model, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Each output token is the reference's greedy token, or within MARGIN of its logit, over
    the prompt and the tokens before it."""
    flips = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + output], device="cuda")
        with torch.no_grad():
            logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(output, device="cuda").view(-1, 1)).view(-1)
        gap = logits.max(dim=1).values - chosen
        assert (gap <= MARGIN).all(), f"tokens {output}: gaps to the reference's top logit {gap.tolist()}"
        flips += int((gap > 0).sum())
    assert flips <= len(prompts) * MAX_TOKENS // 4, f"{flips} tokens not the reference's top one"


@pytest.fixture(scope="module")
def channel_checkpoint(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("fp8") / "tiny-llama-fp8", "tiny-llama", "bfloat16", seed=5,
        quantization="fp8-channel", std=0.05,
    )  # fmt: skip


def test_kept_fp8_projections_agree_with_hf_over_the_dequantized_weights(
    channel_checkpoint, prompts, tmp_path
):
    """fp8-channel kept in FP8 on CUDA (one-row GEMVs in the decode graphs, W8A8 prefill and
    batched decode): HF transformers (float32) over the dequantized weights agrees token by token."""
    from transformers import AutoModelForCausalLM

    engine = cuda_engine(channel_checkpoint, dtype="bfloat16", max_num_seqs=32)
    try:
        model = engine.core.runner.model
        assert all(linear.weight.dtype == torch.float8_e4m3fn for _, linear in projections(model))
        assert engine.core.runner.graphs is not None
        batched = greedy(engine, prompts)
        alone = [greedy(engine, [prompt])[0] for prompt in prompts[:2]]  # batch 1: the GEMVs
    finally:
        engine.shutdown()
    twin = _dequantized_twin(channel_checkpoint, tmp_path / "twin")
    hf = AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).cuda().eval()
    assert_reference_agrees(hf, prompts, batched)
    assert_reference_agrees(hf, prompts[:2], alone)


def test_fp8_block_checkpoint_agrees_with_hf_fine_grained_fp8(tmp_path, prompts):
    """An fp8-block checkpoint (Qwen3-*-FP8's layout: kept in FP8 where cuBLASLt's block-scaled
    GEMM takes tiny-llama's widths, else dequantized at load) against HF transformers' own
    fine-grained FP8 layers (W8A8 per 128-column group), where they load."""
    from transformers import AutoModelForCausalLM

    model_dir = write_random_model(
        tmp_path / "tiny-llama-fp8-block",
        "tiny-llama",
        "bfloat16",
        seed=6,
        quantization="fp8-block",
        std=0.05,
    )
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.bfloat16, device_map="cuda"
        ).eval()
        with torch.no_grad():  # recent transformers fetch the FP8 kernel at the first forward
            hf(torch.tensor([prompts[0]], device="cuda"))
    except Exception as error:  # this transformers build, card or host has no FP8 kernels
        pytest.skip(f"HF fine-grained FP8 does not load here: {type(error).__name__}: {error}")
    assert any("FP8" in type(module).__name__ for module in hf.modules()), "HF dequantized the checkpoint"
    engine = cuda_engine(model_dir, dtype="bfloat16", max_num_seqs=32)
    try:
        outputs = greedy(engine, prompts)
    finally:
        engine.shutdown()
    assert_reference_agrees(hf, prompts, outputs)


@pytest.mark.parametrize("num_rows", [1, 3, 64, 257])
def test_block_scaled_gemm_equals_its_dequantized_product(num_rows):
    """block_scaled_linear on CUDA (cuBLASLt's block-scaled FP8 GEMM, Qwen3-0.6B's MLP widths)
    against float32 over the same quantized activations and the dequantized weight."""
    from paged_llm.layers.fp8_linear import (
        GROUP_COLUMNS,
        _block_scaled_mm,
        block_scaled_linear,
        block_scaled_mm_takes,
        group_dequantized_weight,
        new_group_scales,
        quantize_groups,
    )
    from paged_llm.models import fp8

    device = torch.device("cuda")
    n, k = 1024, 3072
    if not block_scaled_mm_takes(device, k):
        pytest.skip(f"no block-scaled FP8 GEMM on this card / cuBLASLt (torch {torch.__version__})")
    print(f"block-scaled GEMM: {_block_scaled_mm(device)}")
    generator = torch.Generator(device=device).manual_seed(num_rows)
    values = torch.randn(n, k, device=device, generator=generator) * 0.05
    weight, scale = fp8.quantize(values, fp8.KEPT_BLOCK_LAYOUT)
    kept = new_group_scales(n, k, device)
    kept.copy_(fp8.group_scales(scale.cpu(), fp8.KEPT_BLOCK_LAYOUT, None, None, (n, k)))
    x = (torch.randn(num_rows, k, device=device, generator=generator) * 3).to(torch.bfloat16)
    got = block_scaled_linear(x, weight, kept).float()
    quantized, scales = quantize_groups(x)
    activations = quantized.float() * scales.repeat_interleave(GROUP_COLUMNS, dim=1)
    expected = activations @ group_dequantized_weight(weight, kept, torch.float32).t()
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 1e-2, f"relative error {error:.2e}"
