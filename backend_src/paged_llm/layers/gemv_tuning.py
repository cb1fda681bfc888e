"""Launch settings of the one-row GEMV kernels (layers/triton_gemv.py), per weight shape and GPU.

A GEMV streams its weight matrix once; how fast depends on how the N x K matrix is cut into
programs (BLOCK_N rows each, BLOCK_K columns per load) and how many loads are in flight (warps,
pipeline stages). One rule does not suit every shape: a 1024 x 2048 o_proj has few rows to spread
over 132 SMs, a 28672 x 4096 gate/up many. `scripts/bench_gemv.py` measures every candidate for the
shapes of the models we serve (and their tensor-parallel shards) and writes the fastest per shape;
the tables for the cards we measured ship in `gemv_tables/` (named after
`torch.cuda.get_device_name()`), and PAGED_LLM_GEMV_TABLE points at another one. A shape or card not
in a table gets the rule the kernels had before the tables (`default_gemv_config`).

Each kernel has its own section: the plain GEMV ("configs"), the residual-add + RMSNorm + GEMV
("norm_gemv_configs") and the SiLU * up + GEMV ("silu_mul_gemv_configs"). The fused kernels'
programs each recompute the row's statistic or activation, so more, smaller programs cost them more
than the plain GEMV: on the H200 the plain GEMV's best settings made the Llama-3-8B step 1.6% slower
through the fused kernels. A table without a fused kernel's section (written before the sweep timed
them) gives that kernel the plain GEMV's entry for the shape.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_llm.device_kind import is_cuda

logger = logging.getLogger(__name__)

TABLES_DIR = Path(__file__).resolve().parent / "gemv_tables"
TABLE_ENV = "PAGED_LLM_GEMV_TABLE"
# The one-row GEMV kernels of layers/triton_gemv.py and their sections in a table; "fp8_*": the same
# kernels over FP8 weights (half the bytes a load: other settings win).
SECTIONS = {
    "gemv": "configs",
    "norm_gemv": "norm_gemv_configs",
    "silu_mul_gemv": "silu_mul_gemv_configs",
    "fp8_gemv": "fp8_configs",
    "fp8_norm_gemv": "fp8_norm_gemv_configs",
    "fp8_silu_mul_gemv": "fp8_silu_mul_gemv_configs",
}
KERNELS = tuple(SECTIONS)
FP8_PREFIX = "fp8_"


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program
    block_k: int  # columns per load; must divide K (the kernels load whole blocks)
    num_warps: int = 4
    num_stages: int = 3

    def fits(self, k: int) -> bool:
        """Launchable for K: power-of-two blocks and warps (Triton's aranges), BLOCK_K dividing K."""
        powers = (self.block_n, self.block_k, self.num_warps)
        if any(value < 1 or value & (value - 1) for value in powers) or self.num_stages < 1:
            return False
        return k % self.block_k == 0


def default_gemv_config(n: int, k: int, fp8: bool = False) -> GemvConfig:
    """The rule for a shape no table has. FP8 weights: twice the columns a load (the same bytes
    in flight as the 16-bit rule) where that divides K."""
    config = GemvConfig(8 if n >= 4096 else 4, 256 if k <= 1024 else 512)
    if fp8 and k % (2 * config.block_k) == 0:
        return GemvConfig(config.block_n, 2 * config.block_k, config.num_warps, config.num_stages)
    return config


def table_file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def parse_section(entries: dict) -> dict[tuple[int, int], GemvConfig]:
    """{"N,K": [block_n, block_k, num_warps, num_stages], ...} -> {(N, K): config}."""
    table = {}
    for key, values in entries.items():
        n, k = (int(part) for part in key.split(","))
        config = GemvConfig(*(int(v) for v in values))
        if config.fits(k):
            table[(n, k)] = config
        else:
            logger.warning("GEMV table entry %s %s cannot launch for K=%d: ignored", key, values, k)
    return table


def parse_table(payload: dict) -> dict[str, dict[tuple[int, int], GemvConfig]]:
    """A table file's payload -> {kernel: {(N, K): config}}. A fused 16-bit kernel without its own
    section takes the plain GEMV's ("configs", the only section of tables written before); an FP8
    kernel without its section takes the FP8 rule (16-bit settings load half the bytes)."""
    plain = parse_section(payload["configs"])
    table = {}
    for kernel in KERNELS:
        if SECTIONS[kernel] in payload:
            table[kernel] = parse_section(payload[SECTIONS[kernel]])
        else:
            table[kernel] = {} if kernel.startswith(FP8_PREFIX) else plain
    return table


@functools.cache
def _table_for(device_name: str) -> dict[str, dict[tuple[int, int], GemvConfig]]:
    override = os.environ.get(TABLE_ENV)
    path = Path(override) if override else TABLES_DIR / table_file_name(device_name)
    if not path.is_file():
        if override:
            logger.warning("%s=%s: no such file; default GEMV settings", TABLE_ENV, override)
        return {}
    try:
        table = parse_table(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("GEMV table %s unreadable (%s): default GEMV settings", path, error)
        return {}
    counts = ", ".join(f"{kernel} {len(table[kernel])}" for kernel in KERNELS)
    logger.info("GEMV settings from %s (shapes per kernel: %s)", path, counts)
    return table


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gemv_config(n: int, k: int, device: torch.device, kernel: str = "gemv") -> GemvConfig:
    """The measured settings of `kernel` (one of KERNELS) for an n x k weight on this device's card,
    else the default rule."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown GEMV kernel {kernel!r} (one of {', '.join(KERNELS)})")
    if is_cuda(device):
        tuned = _table_for(_device_name(device.index or 0)).get(kernel, {}).get((n, k))
        if tuned is not None:
            return tuned
    return default_gemv_config(n, k, fp8=kernel.startswith(FP8_PREFIX))
