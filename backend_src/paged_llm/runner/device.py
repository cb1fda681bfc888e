"""The one place that knows cpu / cuda / npu: selection, sync, memory, streams, graph capture.

The NPU path uses only portable PyTorch ops plus torch_npu's documented `torch.npu` calls; it is
imported lazily and cannot be exercised on the CI machines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_llm.device_kind import CUDA

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" | "cuda" | "npu"
    index: int | None = None

    @staticmethod
    def resolve(spec: str = "auto") -> Device:
        kind, _, index_text = spec.partition(":")
        index = int(index_text) if index_text else None
        if kind == "auto":
            if torch.cuda.is_available():
                return Device("cuda", index)
            if _npu_available():
                return Device("npu", index)
            return Device("cpu")
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        if kind == "npu" and not _npu_available():
            raise RuntimeError("device 'npu' requested but torch_npu is not installed or sees no NPU")
        return Device(kind, index)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind if self.index is None else f"{self.kind}:{self.index}")

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.kind == CUDA

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def supports_graphs(self) -> bool:
        return self.kind == "cuda"

    @property
    def supports_triton(self) -> bool:
        """Triton (triton-lang) kernels compile for this device."""
        return self.kind == "cuda"

    def _module(self):
        return getattr(torch, self.kind)

    def activate(self) -> None:
        if self.is_accelerator and self.index is not None:
            self._module().set_device(self.index)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._module().synchronize(self.torch_device)

    def memory_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) of device memory; on CPU, available and total system RAM."""
        if self.is_accelerator:
            free, total = self._module().mem_get_info(self.torch_device)
            return int(free), int(total)
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        available = page * os.sysconf("SC_AVPHYS_PAGES")
        return int(available), int(total)

    def allocated_bytes(self) -> int:
        return int(self._module().memory_allocated(self.torch_device)) if self.is_accelerator else 0

    def peak_allocated_bytes(self) -> int:
        return int(self._module().max_memory_allocated(self.torch_device)) if self.is_accelerator else 0

    def reset_peak_stats(self) -> None:
        if self.is_accelerator:
            self._module().reset_peak_memory_stats(self.torch_device)

    def empty_cache(self) -> None:
        if self.is_accelerator:
            self._module().empty_cache()

    def model_dtype(self, requested: str, checkpoint_dtype: str) -> torch.dtype:
        """`auto`: float32 on CPU (bf16 matmuls are slow and inexact there), else the checkpoint's."""
        if requested != "auto":
            return _DTYPES[requested]
        if self.is_cpu:
            return torch.float32
        return _DTYPES.get(checkpoint_dtype, torch.bfloat16)

    @property
    def pin_memory(self) -> bool:
        return self.is_accelerator

    def new_event(self):
        """A device event (record() / synchronize()); None on CPU."""
        return self._module().Event() if self.is_accelerator else None

    @contextlib.contextmanager
    def stream(self, stream) -> Iterator[None]:
        if stream is None:
            yield
            return
        with self._module().stream(stream):
            yield

    def num_multiprocessors(self) -> int | None:
        """Streaming multiprocessors of a CUDA device (kernels size their grids by it); else None."""
        if self.kind != "cuda":
            return None
        return int(torch.cuda.get_device_properties(self.torch_device).multi_processor_count)

    def supports_fp8(self) -> bool:
        """FP8 (e4m3) conversions in the Triton kernels: CUDA compute capability 8.9+ (Ada, Hopper);
        the portable paths (CPU, NPU) convert in PyTorch."""
        if self.kind != "cuda":
            return True
        return torch.cuda.get_device_capability(self.torch_device) >= (8, 9)

    def describe(self) -> str:
        if self.is_accelerator:
            return f"{self.torch_device} ({self._module().get_device_name(self.torch_device)})"
        return "cpu"
