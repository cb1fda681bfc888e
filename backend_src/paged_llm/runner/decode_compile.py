"""torch.compile of the decode forward (DeviceConfig.torch_compile): Inductor generates the
elementwise kernels and picks the matmuls of each decode graph bucket, and the bucket's CUDA graph
then captures the compiled code (Inductor's own CUDA graphs stay off: ours hold the KV addresses).
Only the decode graphs: the model runner captures them inside FusedOps.pytorch_ops(), so prefill,
the mixed-step graphs and eager steps keep our Triton kernels.

The attention backend's calls stay out of the compiled graphs (`OpaqueToCompiler`): each is a graph
break, and the CUDA graph captures the compiled pieces and the attention kernels between them as
one. Inside a compiled graph, Inductor's handling of user Triton kernels failed to compile
_paged_attention_kernel (torch 2.11, triton 3.6, H200: "Loop-carried variable m_i has initial type
fp32 but is re-assigned to fp64").

A measured alternative to the hand-written Triton kernels, not the default: docs/benchmarks.md has
what it gave against them on the GPU hosts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# DeviceConfig.torch_compile -> torch.compile's mode (None: Inductor's default).
INDUCTOR_MODES: dict[str, str | None] = {"default": None, "max-autotune": "max-autotune-no-cudagraphs"}
# Dynamo compiles a frame per graph-break segment, and some get two entries per bucket (the first
# layer has no residual, the others do): room for twice that per bucket, and more.
ENTRIES_PER_BUCKET = 4


def compile_decode_forward(
    forward: Callable[..., torch.Tensor], mode: str, num_buckets: int, backend: str = "inductor"
) -> Callable[..., torch.Tensor]:
    """`forward` compiled once per decode bucket (static shapes: each bucket is one graph anyway).

    Every bucket is a recompile (its batch size, and the metadata's per-row host lists, differ).
    Past Dynamo's recompile limit a frame would run eagerly without saying so, and the CUDA graph
    would capture the uncompiled PyTorch ops: the limit is raised above what the buckets need, and
    hitting it anyway raises. `backend`: tests trace with "eager" (no code generation)."""
    import torch._dynamo.config as dynamo_config

    limit = ENTRIES_PER_BUCKET * num_buckets + 8
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, limit)
    dynamo_config.fail_on_recompile_limit_hit = True
    if backend != "inductor":
        return torch.compile(forward, backend=backend, dynamic=False)
    return torch.compile(forward, mode=INDUCTOR_MODES[mode], dynamic=False)


class OpaqueToCompiler:
    """An attention backend whose forward/attend run as they are under torch.compile (Dynamo does
    not trace into them); everything else is the backend's."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.forward = torch.compiler.disable(backend.forward)
        if hasattr(backend, "attend"):
            self.attend = torch.compiler.disable(backend.attend)

    def __getattr__(self, name: str) -> Any:
        if name == "_backend":  # not set yet (copy, pickle): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self._backend, name)
