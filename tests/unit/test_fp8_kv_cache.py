"""An FP8 (e4m3) KV cache in the portable attention backend: attention over FP8 blocks equals
attention over the values they hold (float32, to 1e-6), keys / values divided by their layer's
scale and saturated on the way in."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.attention.portable import PortableAttention, from_cache, to_cache
from paged_llm.layers.fp8_format import E4M3
from tests.unit.test_triton_attention import build_metadata, make_inputs

BLOCK_SIZE = 4


def _rounded(values: torch.Tensor, scale: float) -> torch.Tensor:
    return from_cache(to_cache(values, E4M3, scale), torch.float32, scale)


@pytest.mark.parametrize(
    "chunks",
    [
        [(5, 1), (9, 1), (0, 1), (12, 1)],  # decodes only
        [(0, 7), (5, 1), (9, 3), (0, 1), (12, 1)],  # prefill with and without context, decodes
    ],
)
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.05, 3.0)])
def test_attention_over_fp8_blocks_equals_attention_over_their_values(chunks, k_scale, v_scale):
    metadata = build_metadata(chunks, BLOCK_SIZE, torch.device("cpu"))
    q, k, v, k_cache, v_cache = make_inputs(metadata, 4, 2, 16, BLOCK_SIZE, torch.float32, "cpu")
    fp8_k, fp8_v = to_cache(k_cache, E4M3, k_scale), to_cache(v_cache, E4M3, v_scale)
    # The reference: a float32 cache holding exactly what the FP8 one holds, and the step's keys
    # and values rounded the same way (the FP8 path reads every key from the cache or as it would).
    ref_k, ref_v = from_cache(fp8_k, torch.float32, k_scale), from_cache(fp8_v, torch.float32, v_scale)
    scale = 16**-0.5
    expected = PortableAttention().forward(
        q, _rounded(k, k_scale), _rounded(v, v_scale), ref_k, ref_v, metadata, scale
    )
    actual = PortableAttention().forward(
        q, k, v, fp8_k, fp8_v, metadata, scale, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert fp8_k.dtype == E4M3
    assert torch.equal(from_cache(fp8_k, torch.float32, k_scale), ref_k)  # the new tokens written alike
    assert torch.equal(from_cache(fp8_v, torch.float32, v_scale), ref_v)
    # and the FP8 rounding is there to see: the unrounded keys give another result
    unrounded = PortableAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, scale)
    assert not torch.allclose(unrounded, actual, rtol=1e-4, atol=1e-4)


def test_entries_are_scaled_and_saturated():
    values = torch.tensor([0.0, 1.0, -2.5, 1000.0, -1000.0, 0.3])
    stored = to_cache(values, E4M3, 2.0)
    assert stored.dtype == E4M3
    assert stored.float().tolist() == [0.0, 0.5, -1.25, 448.0, -448.0, 0.15625]
    assert from_cache(stored, torch.float32, 2.0).tolist() == [0.0, 1.0, -2.5, 896.0, -896.0, 0.3125]
    # a cache in the model dtype ignores the scale
    assert torch.equal(to_cache(values, torch.float32, 2.0), values)


def test_an_fp8_block_takes_a_quarter_of_a_float32_one(tiny_model_dir):
    from paged_llm.models.hf_config import load_model_spec
    from paged_llm.runner.device import Device
    from paged_llm.runner.model_runner import ModelRunner

    spec = load_model_spec(tiny_model_dir)
    runner = ModelRunner(spec, tiny_model_dir, Device("cpu"), torch.float32, 64, 4, fp8_kv_cache=True)
    assert runner.kv_dtype == E4M3 and runner.kv_bytes_per_block * 4 == (
        ModelRunner(spec, tiny_model_dir, Device("cpu"), torch.float32, 64, 4).kv_bytes_per_block
    )


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.25, 2.0)])
@pytest.mark.parametrize("batch", ["mixed", "decodes in 64-row tiles"])
def test_the_triton_kernels_read_and_write_fp8_as_the_portable_path(
    splits, k_scale, v_scale, batch, monkeypatch
):
    """TritonAttention (compiled on CUDA, the interpreter on CPU) over an FP8 cache: the same cache
    bytes and, to 1e-4, the same attention as the portable path. The step's keys and values lie on
    the FP8 grid (times a power-of-two scale) or beyond +-448 x scale (saturated): the Triton 3.6
    interpreter rounds a value just below a power of two down a binade (-1.999 -> -1.0) and flushes
    subnormals, where torch and the GPU's conversion round to nearest."""
    from paged_llm.layers.attention import triton_kernels
    from paged_llm.layers.attention.triton_backend import TritonAttention
    from tests.unit.test_triton_attention import DECODES, DEVICE, MIXED, context_slots

    chunks = MIXED
    if batch == "decodes in 64-row tiles":  # FP8_DECODE_BLOCK_M: the prompt tile's dots for decodes
        chunks = DECODES
        monkeypatch.setattr(triton_kernels, "FP8_DECODE_BLOCK_M", 64)
    device = torch.device(DEVICE)
    metadata = build_metadata(chunks, BLOCK_SIZE, device)
    q, k, v, k_cache, v_cache = make_inputs(metadata, 4, 2, 16, BLOCK_SIZE, torch.float32, device)

    def away_from_zero(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.sign(x) * (x.abs() + 0.03 * scale) * 4

    def on_the_grid(x: torch.Tensor, scale: float) -> torch.Tensor:
        values = _rounded(away_from_zero(x, scale), scale)
        values.view(-1)[::7] = 1000.0 * scale  # saturated on the way in
        return values

    k, v = on_the_grid(k, k_scale), on_the_grid(v, v_scale)
    fp8_k = to_cache(away_from_zero(k_cache, k_scale), E4M3, k_scale)
    fp8_v = to_cache(away_from_zero(v_cache, v_scale), E4M3, v_scale)
    portable_k, portable_v = fp8_k.clone(), fp8_v.clone()
    scale = 16**-0.5
    expected = PortableAttention().forward(
        q, k, v, portable_k, portable_v, metadata, scale, k_scale=k_scale, v_scale=v_scale
    )
    actual = TritonAttention(num_splits=splits).forward(
        q, k, v, fp8_k, fp8_v, metadata, scale, k_scale=k_scale, v_scale=v_scale
    )
    valid = context_slots(metadata, BLOCK_SIZE).to(device)
    for triton_cache, portable_cache in ((fp8_k, portable_k), (fp8_v, portable_v)):
        written = triton_cache.view(torch.uint8).view(-1, 2, 16)[valid]
        assert torch.equal(written, portable_cache.view(torch.uint8).view(-1, 2, 16)[valid])
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)  # as test_triton_attention


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter has no 16-bit dots")
@pytest.mark.parametrize("splits", [1, 4])
def test_a_bf16_model_reads_the_fp8_cache_through_float16_dots(splits):
    """bf16 queries over an FP8 cache (the dots in float16, where e4m3 widens in one instruction):
    within bf16's rounding of the float32 attention over the cache's values."""
    from paged_llm.layers.attention.triton_backend import TritonAttention
    from tests.unit.test_triton_attention import MIXED

    device = torch.device("cuda")
    metadata = build_metadata(MIXED, BLOCK_SIZE, device)
    q, k, v, k_cache, v_cache = make_inputs(metadata, 4, 2, 64, BLOCK_SIZE, torch.float32, device)
    q, k, v = (x.bfloat16().float() for x in (q, k, v))  # both sides write the same values
    fp8_k, fp8_v = to_cache(k_cache, E4M3, 0.5), to_cache(v_cache, E4M3, 2.0)
    expected = PortableAttention().forward(
        q, k, v, fp8_k.clone(), fp8_v.clone(), metadata, 0.125, k_scale=0.5, v_scale=2.0
    )
    actual = TritonAttention(num_splits=splits).forward(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), fp8_k, fp8_v, metadata, 0.125, k_scale=0.5, v_scale=2.0
    )
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2)
