"""Which kind of device a torch.device is, for the modules below the runner (layers/, sampling/)
that choose a path by device kind. The runner and above ask runner/device.py's Device instead.

Torch-free at import (torch appears only in type hints), so it sits with the foundation modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CUDA = "cuda"


def is_cuda(device: torch.device) -> bool:
    return device.type == CUDA
