"""The decoder's ops, bound once per model: `FusedOps` picks the Triton kernels on CUDA
(layers/triton_elementwise.py, layers/triton_gemv.py), else the PyTorch versions
(layers/torch_ops.py), oneDNN for float32 linear layers on CPU (layers/cpu_linear.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from paged_llm.layers.cpu_linear import onednn_linear
from paged_llm.layers.torch_ops import (
    linear_torch,
    norm_then_linear,
    qk_norm_rope_torch,
    rms_norm_torch,
    silu_and_mul_torch,
    silu_mul_then_linear,
)
from paged_llm.layers.triton_elementwise import (
    qk_norm_rope_triton,
    qk_norm_rope_write_kv_triton,
    rms_norm_triton,
    silu_and_mul_triton,
    triton,
)
from paged_llm.layers.triton_gemv import linear_triton, norm_linear_triton, silu_mul_linear_triton


class FusedOps:
    """The decoder's elementwise ops: Triton kernels when `use_triton`, else the PyTorch versions.
    The decoder's modules share one instance and read its ops at every call."""

    def __init__(self, use_triton: bool, use_gemv: bool = True, use_onednn: bool = False) -> None:
        """`use_onednn`: float32 linear layers on CPU through oneDNN (layers/cpu_linear.py)."""
        self._settings = (use_triton, use_gemv, use_onednn)
        self._bind(*self._settings)

    def _bind(self, use_triton: bool, use_gemv: bool, use_onednn: bool) -> None:
        self.use_triton = use_triton and triton is not None
        self.rms_norm = rms_norm_triton if self.use_triton else rms_norm_torch
        self.qk_norm_rope = qk_norm_rope_triton if self.use_triton else qk_norm_rope_torch
        # With an attention backend that reads a cache written here (TritonAttention.attend).
        self.qk_norm_rope_write_kv = qk_norm_rope_write_kv_triton if self.use_triton else None
        self.silu_and_mul = silu_and_mul_triton if self.use_triton else silu_and_mul_torch
        # Every linear op takes (x, weight, bias=None, weight_scale=None): `weight_scale` with an FP8
        # weight (layers/fp8_linear.py).
        self.linear: Callable[..., torch.Tensor] = (
            linear_triton if self.use_triton and use_gemv else linear_torch
        )
        # The LM head: cuBLAS on CUDA (the Triton GEMV was measured on the layers' shapes only).
        self.lm_head_linear: Callable[..., torch.Tensor] = F.linear
        if not self.use_triton and use_onednn:
            self.linear = self.lm_head_linear = onednn_linear
        self.norm_linear = functools.partial(norm_then_linear, self.rms_norm, self.linear)
        if self.use_triton and use_gemv:  # one kernel each for a one-row batch
            self.norm_linear = norm_linear_triton
            self.silu_mul_linear = silu_mul_linear_triton
        else:
            self.silu_mul_linear = functools.partial(silu_mul_then_linear, self.silu_and_mul, self.linear)

    @contextlib.contextmanager
    def pytorch_ops(self) -> Iterator[None]:
        """Inside: the PyTorch versions of every op (what torch.compile traces and generates its own
        kernels for, runner/decode_compile.py); after: the ops this instance was built with."""
        self._bind(use_triton=False, use_gemv=False, use_onednn=False)
        try:
            yield
        finally:
            self._bind(*self._settings)
