"""torch.compile of the decode forward (DeviceConfig.torch_compile): Inductor generates the
elementwise kernels and picks the matmuls of each decode graph bucket, and the bucket's CUDA graph
then captures the compiled code (Inductor's own CUDA graphs stay off: ours hold the KV addresses).

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


def compile_decode_forward(
    forward: Callable[..., torch.Tensor], mode: str, num_buckets: int
) -> Callable[..., torch.Tensor]:
    """`forward` compiled once per decode bucket (static shapes: each bucket is one graph anyway).

    Every bucket is a recompile (its batch size, and the metadata's per-row host lists, differ), so
    the recompile limit is raised above the bucket count: past the limit Dynamo would run the
    forward eagerly without saying so in the step's results."""
    import torch._dynamo

    limit = num_buckets + 8
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, limit
    )
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
        return getattr(self._backend, name)
