"""An FP8 (e4m3) KV cache in the portable attention backend: attention over FP8 blocks equals
attention over the values they hold (float32, to 1e-6), keys / values divided by their layer's
scale and saturated on the way in."""

from __future__ import annotations

import pytest
import torch

from paged_llm.layers.attention.portable import FP8_KV_DTYPE, PortableAttention, from_cache, to_cache
from tests.unit.test_triton_attention import build_metadata, make_inputs

BLOCK_SIZE = 4


def _rounded(values: torch.Tensor, scale: float) -> torch.Tensor:
    return from_cache(to_cache(values, FP8_KV_DTYPE, scale), torch.float32, scale)


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
    fp8_k, fp8_v = to_cache(k_cache, FP8_KV_DTYPE, k_scale), to_cache(v_cache, FP8_KV_DTYPE, v_scale)
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
    assert fp8_k.dtype == FP8_KV_DTYPE
    assert torch.equal(from_cache(fp8_k, torch.float32, k_scale), ref_k)  # the new tokens written alike
    assert torch.equal(from_cache(fp8_v, torch.float32, v_scale), ref_v)
    # and the FP8 rounding is there to see: the unrounded keys give another result
    unrounded = PortableAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, scale)
    assert not torch.allclose(unrounded, actual, rtol=1e-4, atol=1e-4)


def test_entries_are_scaled_and_saturated():
    values = torch.tensor([0.0, 1.0, -2.5, 1000.0, -1000.0, 0.3])
    stored = to_cache(values, FP8_KV_DTYPE, 2.0)
    assert stored.dtype == FP8_KV_DTYPE
    assert stored.float().tolist() == [0.0, 0.5, -1.25, 448.0, -448.0, 0.15625]
    assert from_cache(stored, torch.float32, 2.0).tolist() == [0.0, 1.0, -2.5, 896.0, -896.0, 0.3125]
    # a cache in the model dtype ignores the scale
    assert torch.equal(to_cache(values, torch.float32, 2.0), values)


def test_attention_kernels_that_read_no_fp8_are_refused_at_start(tiny_model_dir):
    from paged_llm.config import ConfigError
    from paged_llm.layers.attention.triton_backend import TritonAttention
    from paged_llm.models.hf_config import load_model_spec
    from paged_llm.runner.device import Device
    from paged_llm.runner.model_runner import ModelRunner

    spec = load_model_spec(tiny_model_dir)
    with pytest.raises(ConfigError, match="kv_cache_dtype fp8 is read by the portable attention backend"):
        ModelRunner(spec, tiny_model_dir, Device("cpu"), torch.float32, 64, 4, attention=TritonAttention(),
                    fp8_kv_cache=True)  # fmt: skip
    runner = ModelRunner(spec, tiny_model_dir, Device("cpu"), torch.float32, 64, 4, fp8_kv_cache=True)
    assert runner.kv_dtype == FP8_KV_DTYPE and runner.kv_bytes_per_block * 4 == (
        ModelRunner(spec, tiny_model_dir, Device("cpu"), torch.float32, 64, 4).kv_bytes_per_block
    )
