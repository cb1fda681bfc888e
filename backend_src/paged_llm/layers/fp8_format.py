"""The FP8 format the engine stores, for weights and the KV cache alike: e4m3 without infinities
(torch.float8_e4m3fn, Triton's float8e4nv). A cast to it need not saturate: writers clamp first."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite value
