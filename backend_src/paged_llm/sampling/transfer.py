"""Host-to-device copies that do not wait for the device.

A plain `tensor.to("cuda")` from pageable memory synchronises the stream: with asynchronous
scheduling (the next step prepared while the current one runs) that would wait for the running step.
Staging through pinned memory makes the copy an ordinary queued operation.
"""

from __future__ import annotations

import torch

from paged_llm.device_kind import is_cuda


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if is_cuda(device):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
