"""The fused Triton ops against their PyTorch versions (CPU: Triton interpreter; GPU: compiled)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_llm.layers.attention.triton_kernels import write_kv_cache
from paged_llm.layers.torch_ops import (
    qk_norm_rope_torch,
    rms_norm_torch,
    silu_and_mul_torch,
    silu_mul_linear_torch,
)
from paged_llm.layers.triton_elementwise import (
    qk_norm_rope_triton,
    qk_norm_rope_write_kv_triton,
    rms_norm_triton,
    silu_and_mul_triton,
)
from paged_llm.layers.triton_gemv import norm_linear_triton
from paged_llm.models.decoder import RotaryEmbedding
from paged_llm.models.hf_config import RopeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter has no bfloat16 arithmetic; bf16 runs where the kernels really compile.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # Same operations in the same order: at most one rounding step apart (float32 sums may differ).
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1024])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    x, residual = randn(5, hidden, dtype=dtype, seed=1), randn(5, hidden, dtype=dtype, seed=2)
    weight = 1 + 0.1 * randn(hidden, dtype=dtype, seed=3)
    for res in (None, residual):
        out, new_residual = rms_norm_triton(x, weight, 1e-6, res)
        want_out, want_residual = rms_norm_torch(x, weight, 1e-6, res)
        assert_same(out, want_out, dtype)
        assert torch.equal(new_residual, want_residual)  # one rounded add, exactly as torch does it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "with_norm"), [(16, True), (128, True), (64, False), (80, False)])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (6, 3)])  # 6 and 3: padded head tiles
def test_qk_norm_rope_matches_torch_on_strided_views(dtype, head_dim, with_norm, q_heads, kv_heads):
    tokens = 7
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # non-contiguous views, as in the model
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, RopeSpec(theta=1e6), max_positions=512)
    rotary.build(torch.device(DEVICE), dtype)
    positions = torch.tensor([0, 1, 5, 100, 511, 7, 3], device=DEVICE)
    q_weight = 1 + 0.1 * randn(head_dim, dtype=dtype, seed=5) if with_norm else None
    k_weight = 1 + 0.1 * randn(head_dim, dtype=dtype, seed=6) if with_norm else None
    got_q, got_k = qk_norm_rope_triton(q, k, q_weight, k_weight, 1e-6, rotary.cos_sin, positions)
    want_q, want_k = qk_norm_rope_torch(q, k, q_weight, k_weight, 1e-6, rotary.cos_sin, positions)
    assert_same(got_q, want_q, dtype)
    assert_same(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "with_norm"), [(16, True), (128, True), (80, False)])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (6, 3)])
def test_rope_that_writes_the_kv_cache_leaves_it_as_the_separate_write_does(
    dtype, head_dim, with_norm, q_heads, kv_heads
):
    """The decoder's fused path (q/k-norm + RoPE writing k and v to their cache slots, then
    TritonAttention.attend) against qk_norm_rope_triton + write_kv_cache: the same q, the same
    cache bits, and padding rows (slot -1) write nothing."""
    tokens, block_size, num_blocks = 6, 4, 5
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=8)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, RopeSpec(theta=1e6), max_positions=64)
    rotary.build(torch.device(DEVICE), dtype)
    positions = torch.tensor([0, 1, 2, 9, 10, 0], device=DEVICE)
    slots = torch.tensor([3, 17, 0, 12, 5, -1], device=DEVICE)  # scattered; the last row is padding
    q_weight = 1 + 0.1 * randn(head_dim, dtype=dtype, seed=9) if with_norm else None
    k_weight = 1 + 0.1 * randn(head_dim, dtype=dtype, seed=10) if with_norm else None
    shape = (num_blocks, block_size, kv_heads, head_dim)
    want_k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    want_v_cache = want_k_cache.clone()
    got_k_cache, got_v_cache = want_k_cache.clone(), want_v_cache.clone()
    want_q, rotated_k = qk_norm_rope_triton(q, k, q_weight, k_weight, 1e-6, rotary.cos_sin, positions)
    write_kv_cache(rotated_k, v, want_k_cache, want_v_cache, slots)
    got_q = qk_norm_rope_write_kv_triton(
        q, k, v, q_weight, k_weight, 1e-6, rotary.cos_sin, positions, got_k_cache, got_v_cache, slots
    )
    assert torch.equal(got_q, want_q)
    for got, want in ((got_k_cache, want_k_cache), (got_v_cache, want_v_cache)):
        assert torch.equal(got.isnan(), want.isnan())  # the same slots written, the rest untouched
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert int((~got_k_cache.isnan()).all(-1).all(-1).sum()) == 5  # 5 slots, none for the padding row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [128, 3072, 1500])
def test_silu_and_mul(dtype, size):
    gate_up = randn(3, 2 * size, dtype=dtype, seed=7)
    assert_same(silu_and_mul_triton(gate_up), silu_and_mul_torch(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize(("n", "k"), [(1024, 2048), (6144, 1024), (100, 512), (4096, 3072)])
def test_one_row_linear_takes_the_gemv_and_matches_cublas(dtype, n, k, monkeypatch):
    from paged_llm.layers import triton_gemv

    x = randn(1, k, dtype=dtype, seed=1)
    weight = randn(n, k, dtype=dtype, seed=2) / k**0.5
    calls = record_launches(monkeypatch, triton_gemv, "_gemv_kernel")
    actual = triton_gemv.linear_triton(x, weight)
    assert calls, "the one-row GEMV was not used"
    expected = (x.float() @ weight.float().T).to(dtype)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("rows", "dtype", "k", "with_bias"),
    [(2, torch.float16, 512, False), (1, torch.float32, 512, False), (1, torch.float16, 300, False),
     (1, torch.float16, 512, True)],
)  # fmt: skip
def test_other_linears_stay_on_torch(rows, dtype, k, with_bias, monkeypatch):
    from paged_llm.layers import triton_gemv

    x = randn(rows, k, dtype=dtype, seed=3)
    weight = randn(64, k, dtype=dtype, seed=4)
    bias = randn(64, dtype=dtype, seed=5) if with_bias else None
    calls = record_launches(monkeypatch, triton_gemv, "_gemv_kernel")
    actual = triton_gemv.linear_triton(x, weight, bias)
    assert not calls
    torch.testing.assert_close(actual, torch.nn.functional.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize(
    ("n", "k"), [(100, 512), (96, 2048)] + ([(1024, 3072), (4096, 1024)] if DEVICE == "cuda" else [])
)  # the Qwen3-0.6B / Llama shapes take ~10 s each in the CPU interpreter
def test_one_row_silu_mul_linear_is_one_kernel_equal_to_the_two(dtype, n, k, monkeypatch):
    """The MLP's activation fused into its down projection (one row): one launch with the settings
    of its own kernel, and the same bits as silu_and_mul then the GEMV (it rounds the activation as
    they do) where both launch with the same settings (a table may give them different ones, which
    sums in another order)."""
    from paged_llm.layers import triton_gemv

    gate_up = randn(1, 2 * k, dtype=dtype, seed=8)
    weight = randn(n, k, dtype=dtype, seed=9) / k**0.5
    calls = record_launches(monkeypatch, triton_gemv, "_silu_mul_gemv_kernel")
    kernels_asked = record_settings_asked(monkeypatch, triton_gemv)
    actual = triton_gemv.silu_mul_linear_triton(gate_up, weight)
    assert len(calls) == 1 and kernels_asked == ["silu_mul_gemv"]
    two_kernels = triton_gemv.linear_triton(silu_and_mul_triton(gate_up), weight)
    assert torch.equal(actual, two_kernels)
    expected = silu_mul_linear_torch(gate_up.float(), weight.float()).to(dtype)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("rows", "dtype"), [(3, torch.float16), (1, torch.float32)])
def test_other_silu_mul_linears_take_the_two_ops(rows, dtype, monkeypatch):
    from paged_llm.layers import triton_gemv

    gate_up = randn(rows, 1024, dtype=dtype, seed=10)
    weight = randn(64, 512, dtype=dtype, seed=11)
    calls = record_launches(monkeypatch, triton_gemv, "_silu_mul_gemv_kernel")
    actual = triton_gemv.silu_mul_linear_triton(gate_up, weight)
    assert not calls
    assert_same(actual, silu_mul_linear_torch(gate_up, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize(("n", "k"), [(96, 256), (40, 512)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_one_row_norm_linear_is_one_kernel_equal_to_norm_then_linear(dtype, n, k, with_residual, monkeypatch):
    """The decoder's residual-add + RMSNorm + projection for a one-row batch (_norm_gemv_kernel)
    against rms_norm_triton then linear_triton: the same residual bits, the output within float32
    summation order; more rows take the two ops."""
    from paged_llm.layers import triton_gemv

    x, residual = randn(1, k, dtype=dtype, seed=11), randn(1, k, dtype=dtype, seed=12)
    norm_weight = 1 + 0.1 * randn(k, dtype=dtype, seed=13)
    weight = randn(n, k, dtype=dtype, seed=14) / k**0.5
    res = residual if with_residual else None
    calls = record_launches(monkeypatch, triton_gemv, "_norm_gemv_kernel")
    kernels_asked = record_settings_asked(monkeypatch, triton_gemv)
    out, new_residual = norm_linear_triton(x, res, norm_weight, 1e-6, weight)
    assert len(calls) == 1 and kernels_asked == ["norm_gemv"]
    normed, want_residual = rms_norm_triton(x, norm_weight, 1e-6, res)
    assert torch.equal(new_residual, want_residual)
    assert_same(out, triton_gemv.linear_triton(normed, weight), dtype)
    rows = randn(3, k, dtype=dtype, seed=15)
    out3, _ = norm_linear_triton(rows, None, norm_weight, 1e-6, weight)
    assert len(calls) == 1  # three rows: rms_norm + cuBLAS
    assert_same(out3, torch.nn.functional.linear(rms_norm_triton(rows, norm_weight, 1e-6)[0], weight), dtype)


def record_settings_asked(monkeypatch, triton_gemv) -> list[str]:
    """Records the kernel names triton_gemv asks launch settings for, and gives every kernel the plain
    GEMV's settings (so a fused kernel and the two ops it replaces sum in the same order)."""
    from paged_llm.layers import gemv_tuning

    kernels_asked: list[str] = []

    def plain_settings(n: int, k: int, device: torch.device, kernel: str = "gemv"):
        kernels_asked.append(kernel)
        return gemv_tuning.gemv_config(n, k, device, "gemv")

    monkeypatch.setattr(triton_gemv, "gemv_config", plain_settings)
    return kernels_asked


def record_launches(monkeypatch, module, kernel_name: str) -> list:
    """Replaces `module.<kernel_name>` for the test with a _Recorder; returns its launch grids."""
    calls: list = []
    monkeypatch.setattr(module, kernel_name, _Recorder(getattr(module, kernel_name), calls))
    return calls


class _Recorder:
    """Wraps a Triton kernel: records launches, then launches it."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]
