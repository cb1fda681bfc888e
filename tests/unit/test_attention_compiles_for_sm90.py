"""The attention kernel compiles for Hopper (sm90) on a machine without a GPU: Triton's code
generator and the wheel's ptxas, the step a GPU host takes at its first launch. The CPU
interpreter runs the kernels' Python semantics only; this catches what only the compiler rejects
(loop-carried types, a while loop's shape) before a GPU run does. In a subprocess: the tests'
process runs Triton in interpreter mode (TRITON_INTERPRET=1), which has no compiler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not _PTXAS.exists(), reason="no ptxas in the triton wheel")

_COMPILE = r"""
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_llm.layers.attention import triton_kernels

flat_grid, kv_fp8 = sys.argv[1] == "flat", sys.argv[2] == "fp8"
kernel = triton_kernels._paged_attention_kernel
names = list(inspect.signature(kernel.fn).parameters)
constants = dict(
    GROUP=2, GROUP_P=2, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_SIZE=16, BLOCK_Q=32, BLOCK_M=64, TILE_N=64,
    NUM_SPLITS=2, MIN_SPLIT_KEYS=256, DOT_FP32=False, DOT_PRECISION="tf32", PREFETCH_BLOCKS=True,
    KV_FP8=kv_fp8, FLAT_GRID=flat_grid,
)
signature = {}
for name in names:
    if name in constants:
        signature[name] = "constexpr"
    elif name.endswith("_ptr"):
        kind = {"query_start_loc_ptr": "i32", "seq_lens_ptr": "i32", "block_tables_ptr": "i32"}.get(name)
        if kind is None:
            kind = "fp32" if name.startswith("part_") else "bf16"
            if kv_fp8 and name in ("k_cache_ptr", "v_cache_ptr"):
                kind = "fp8e4nv"
        signature[name] = "*" + kind
    else:
        signature[name] = "fp32" if name in ("scale_log2", "k_scale", "v_scale") else "i32"
source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
assert compiled.asm["cubin"]
print("compiled", len(compiled.asm["cubin"]), "bytes of cubin")
"""


@pytest.mark.parametrize("flat_grid", ["flat", "by_sequence"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_prompt_tiles_compile_for_sm90(flat_grid, kv_dtype, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile each time, not a cached one
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE, flat_grid, kv_dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bytes of cubin" in result.stdout
