"""Linear layers on CPU in float32 through oneDNN instead of F.linear.

F.linear in float32 on CPU goes to MKL's GEMM, which on the 2-core CI-type VM (AMD EPYC, AVX-512,
torch 2.13) reads a one-row GEMV's weights at ~16 GB/s with one thread or two, while the machine
reads memory at ~33 GB/s (`tensor.sum()`), and gets slower still at 4-16 rows (5-8 GB/s). oneDNN's
matmul (torch.ops.mkldnn._linear_pointwise, what torch.compile's CPU code calls) reads the same
weights at 26-32 GB/s at one row and is 1.1-3.7x faster at every row count measured up to 2,048
(Qwen3-0.6B shapes, `docs/benchmarks.md`, "CPU batch-1 decode against HF"). HF transformers runs
F.linear, so this is where we read the same bytes faster than it does.

oneDNN costs ~15-20 us more per call, so small matrices stay on F.linear: it applies from
`MIN_IN_FEATURES` inputs and `MIN_WEIGHT_ELEMENTS` weights on (the built-in tiny model, hidden size
64, never uses it). The choice depends only on the weight's shape, never on a timing, so a model's
outputs are the same from run to run. oneDNN sums in another order than MKL: logits differ from
F.linear's by ~1e-6 relative (greedy tokens stay HF's; tests/integration/test_cpu_linear.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from paged_llm.layers.fp8_linear import fp8_linear

MIN_IN_FEATURES = 512
MIN_WEIGHT_ELEMENTS = 1 << 20  # 4 MiB of float32


def onednn_linear_op_exists() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_linear_available() -> bool:
    """oneDNN's linear is there and agrees with F.linear on a small probe (once per process)."""
    if not onednn_linear_op_exists():
        return False
    op = torch.ops.mkldnn._linear_pointwise
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=generator)
    weight = torch.randn(16, 64, generator=generator)
    try:
        with torch.inference_mode():
            out = op(x, weight, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(out, F.linear(x, weight), rtol=1e-4, atol=1e-4))


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() == 2
        and weight.shape[1] >= MIN_IN_FEATURES
        and weight.numel() >= MIN_WEIGHT_ELEMENTS
        and onednn_linear_available()
    )


def onednn_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN where that is faster (see the module docstring).
    `weight_scale`: an FP8 weight's row scales (layers/fp8_linear.py, which dequantizes it here)."""
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if bias is not None:
        bias = bias.contiguous()  # oneDNN reads it densely: a strided bias gives wrong sums
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), bias, "none", [], "")
