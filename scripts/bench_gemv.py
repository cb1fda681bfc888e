"""Sweeps the launch settings of the one-row GEMV kernels (layers/triton_gemv.py) over the weight shapes
of the models we serve and their tensor-parallel shards, each shape through the kernel the decoder
runs it with (q/k/v and gate/up: residual-add + RMSNorm + GEMV; o_proj: the plain GEMV; down: SiLU *
up + GEMV), and writes the fastest per kernel and shape: the table layers/gemv_tuning.py reads
(gemv_tables/<card>.json, or PAGED_LLM_GEMV_TABLE).

Each timing is a CUDA graph of back-to-back calls over enough copies of the weight that none is
still in L2 when it comes round again (as in a model, where every layer has its own weights);
cuBLAS (F.linear, after the unfused PyTorch norm or activation for the fused kernels) and the
default settings are timed the same way, and every result is checked against the PyTorch ops. The
norm kernel is timed with a residual (every layer but the first has one).

    python scripts/bench_gemv.py --write backend_src/paged_llm/layers/gemv_tables/auto \\
        --json gemv_sweep.json     # auto: the file name comes from the card's name
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from tqdm import tqdm

from paged_llm.layers.fp8_linear import dequantized_weight, fp8_linear
from paged_llm.layers.gemv_tuning import (
    FP8_PREFIX,
    SECTIONS,
    GemvConfig,
    default_gemv_config,
    table_file_name,
)
from paged_llm.layers.parallel import ShardPlan
from paged_llm.layers.torch_ops import rms_norm_torch, silu_and_mul_torch
from paged_llm.layers.triton_gemv import _gemv_kernel, _norm_gemv_kernel, _silu_mul_gemv_kernel
from paged_llm.models import fp8 as fp8_format
from paged_llm.models.hf_config import load_model_spec
from paged_llm.models.random_model import SHAPES

MIN_CALLS_PER_GRAPH = 32
L2_FLUSH_BYTES = 256 * 1024 * 1024  # rotate over at least this much weight
KERNEL_OF_LAYER = {"qkv": "norm_gemv", "gate_up": "norm_gemv", "o_proj": "gemv", "down": "silu_mul_gemv"}
EPS = 1e-6


def model_shapes(shape: str, world_size: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of each GEMV of one rank's layer, from the engine's own ShardPlan."""
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "config.json").write_text(json.dumps(SHAPES[shape]))
        spec = load_model_spec(Path(scratch))
    plan = ShardPlan.of(spec, 0, world_size)
    q_width = plan.num_heads * spec.head_dim
    return [
        ("qkv", q_width + 2 * plan.num_kv_heads * spec.head_dim, spec.hidden_size),
        ("o_proj", spec.hidden_size, q_width),
        ("gate_up", 2 * plan.intermediate_size, spec.hidden_size),
        ("down", spec.hidden_size, plan.intermediate_size),
    ]


def candidates(n: int, k: int, fp8: bool = False) -> list[GemvConfig]:
    """FP8 weights: a load of the same bytes holds twice the columns. The rule's own setting is
    always a candidate: default_us is measured against it even where the grid skips it."""
    default = default_gemv_config(n, k, fp8)
    configs = [default] if default.fits(k) else []
    block_ks = (512, 1024, 2048) if fp8 else (256, 512, 1024)
    max_tile = 16384 if fp8 else 8192
    stages = (2, 4) if fp8 else (2, 3, 4)  # fewer: each setting is a compile (~1 s)
    grid = itertools.product((2, 4, 8, 16), block_ks, (4, 8), stages)
    for block_n, block_k, warps, stages in grid:
        if k % block_k == 0 and block_n * block_k <= max_tile:
            config = GemvConfig(block_n, block_k, warps, stages)
            if config != default:
                configs.append(config)
    return configs


def time_us(run, num_copies: int) -> float:
    """Microseconds per call: one graph reading every copy at least once, median of 15 replays."""
    calls = max(MIN_CALLS_PER_GRAPH, num_copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            run(i % num_copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            run(i % num_copies)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(samples)[len(samples) // 2]


class KernelCase:
    """One kernel on one N x K shape: its inputs, a launcher per setting, the PyTorch reference."""

    def __init__(self, kernel: str, n: int, k: int, device: torch.device, fp8: bool = False) -> None:
        self.kernel, self.n, self.k, self.fp8 = kernel, n, k, fp8
        self.weight_bytes = n * k * (1 if fp8 else 2)
        self.num_copies = max(2, -(-L2_FLUSH_BYTES // self.weight_bytes))
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.weights = [torch.randn(n, k, **bf16) * 0.02 for _ in range(self.num_copies)]
        self.scales: list[torch.Tensor | None] = [None] * self.num_copies
        if fp8:  # each copy quantized a row at a time, as the loader keeps FP8 weights
            quantized = [fp8_format.quantize(w, fp8_format.ONLINE_LAYOUT) for w in self.weights]
            self.weights = [w for w, _ in quantized]
            self.scales = [scale.view(-1) for _, scale in quantized]
        width = 2 * k if kernel == "silu_mul_gemv" else k
        self.x = torch.randn(1, width, **bf16)
        self.residual = torch.randn(1, k, **bf16)
        self.norm_weight = 1 + 0.1 * torch.randn(k, **bf16)
        self.out = torch.empty(1, n, **bf16)
        self.residual_out = torch.empty(1, k, **bf16)

    def unfused_input(self) -> torch.Tensor:
        """The GEMV's input as the PyTorch ops compute it (norm or activation first)."""
        if self.kernel == "norm_gemv":
            return rms_norm_torch(self.x, self.norm_weight, EPS, self.residual)[0]
        if self.kernel == "silu_mul_gemv":
            return silu_and_mul_torch(self.x)
        return self.x

    def reference_weight(self, i: int) -> torch.Tensor:
        if not self.fp8:
            return self.weights[i]
        return dequantized_weight(self.weights[i], self.scales[i], torch.bfloat16)

    def cublas(self, i: int) -> None:
        """cuBLAS's one row: bf16 F.linear; FP8 weights: the W8A8 GEMM of layers/fp8_linear.py."""
        if self.fp8:
            self.out.copy_(fp8_linear(self.unfused_input(), self.weights[i], self.scales[i]))
        else:
            torch.mm(self.unfused_input(), self.weights[i].t(), out=self.out)

    def launcher(self, config: GemvConfig):
        grid = (triton.cdiv(self.n, config.block_n),)
        blocks = dict(
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )  # fmt: skip
        n, k, scaled = self.n, self.k, self.fp8

        def run(i: int) -> None:
            scale = self.scales[i] if scaled else self.weights[i]
            if self.kernel == "norm_gemv":
                _norm_gemv_kernel[grid](
                    self.x, self.residual, self.norm_weight, self.weights[i], scale, self.out,
                    self.residual_out, n, k, EPS, HAS_RESIDUAL=True, W_SCALED=scaled,
                    K_P=triton.next_power_of_2(k), **blocks,
                )  # fmt: skip
            elif self.kernel == "silu_mul_gemv":
                _silu_mul_gemv_kernel[grid](
                    self.x, self.weights[i], scale, self.out, n, k, W_SCALED=scaled, **blocks
                )  # fmt: skip
            else:
                _gemv_kernel[grid](self.x, self.weights[i], scale, self.out, n, k, W_SCALED=scaled, **blocks)

        return run


def sweep_shape(kernel: str, n: int, k: int, device: torch.device, fp8: bool = False) -> dict:
    case = KernelCase(kernel, n, k, device, fp8)
    reference = F.linear(case.unfused_input(), case.reference_weight(0)).float()
    results = {"cublas_us": time_us(case.cublas, case.num_copies)}
    timings = []
    for config in candidates(n, k, fp8):
        case.out.fill_(float("nan"))  # a launch that writes nothing must not pass on the last result
        case.residual_out.fill_(float("nan"))
        case.launcher(config)(0)
        torch.cuda.synchronize()
        if not torch.allclose(case.out.float(), reference, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"{kernel} {n}x{k} {config}: wrong result")
        if kernel == "norm_gemv" and not torch.equal(case.residual_out, case.x + case.residual):
            raise AssertionError(f"{kernel} {n}x{k} {config}: wrong new residual")
        timings.append((time_us(case.launcher(config), case.num_copies), config))
    default = default_gemv_config(n, k, fp8)
    results["default_us"] = next(us for us, c in timings if c == default) if default.fits(k) else None
    best_us, best = min(timings, key=lambda item: item[0])
    results.update(best_us=best_us, best=[best.block_n, best.block_k, best.num_warps, best.num_stages])
    results["best_tb_per_s"] = case.weight_bytes / best_us / 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="qwen3-0.6b:1,llama3-8b:1,llama3-8b:2,llama3-8b:4,llama3-70b:4,llama3-70b:8",
        help="shape:tensor_parallel_size, comma-separated",
    )  # fmt: skip
    parser.add_argument("--write", type=Path, help="table path, or a directory/auto for the card's file name")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 weights with a scale a row (the fp8_* sections; --write keeps the table's other sections)",
    )
    parser.add_argument("--json", type=Path, help="every timing")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    card = torch.cuda.get_device_name(device)
    shapes: dict[tuple[str, int, int], list[str]] = {}
    for item in args.models.split(","):
        shape, world_size = item.split(":")
        for name, n, k in model_shapes(shape, int(world_size)):
            shapes.setdefault((KERNEL_OF_LAYER[name], n, k), []).append(f"{shape} TP{world_size} {name}")
    rows = {}
    prefix = FP8_PREFIX if args.fp8 else ""
    for (kernel, n, k), names in tqdm(sorted(shapes.items()), desc="shapes", file=sys.stderr):
        rows[f"{prefix}{kernel} {n},{k}"] = {"used_by": names, **sweep_shape(kernel, n, k, device, args.fp8)}
    weights = "FP8 weights (a scale a row), bf16 activations" if args.fp8 else "bf16"
    print(f"{card}: one-row GEMV kernels, {weights}, us per call (weights not in L2)")
    if args.fp8:
        print("cuBLAS: the W8A8 GEMM (torch._scaled_mm) after the unfused norm / activation")
    else:
        print("cuBLAS: F.linear after the unfused norm / activation (their time included)")
    header = f"{'kernel':>14}{'N x K':>14}{'cuBLAS':>9}{'default':>9}{'best':>8}{'TB/s':>7}"
    print(header + "  best [BN, BK, warps, stages]  used by")
    for key, row in rows.items():
        kernel, shape = key.split(" ")
        default = f"{row['default_us']:.1f}" if row["default_us"] is not None else "-"
        used_by = ", ".join(row["used_by"])
        print(
            f"{kernel:>14}{shape.replace(',', ' x '):>14}{row['cublas_us']:>9.1f}{default:>9}"
            f"{row['best_us']:>8.1f}{row['best_tb_per_s']:>7.2f}  {row['best']!s:<28} {used_by}"
        )
    if args.json:
        args.json.write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    if args.write:
        path = args.write
        if path.name == "auto" or path.is_dir():
            path = (path.parent if path.name == "auto" else path) / table_file_name(card)
        table: dict = {"device": card, "measured_by": "scripts/bench_gemv.py"}
        if path.is_file():  # the sections this sweep did not measure stay as they were
            table.update(json.loads(path.read_text()))
        swept = [section for kernel, section in SECTIONS.items() if kernel.startswith(FP8_PREFIX) == args.fp8]
        table.update({section: {} for section in swept})
        for key, row in rows.items():
            kernel, shape = key.split(" ")
            # Only where it beats the rule by 3% (the rule's own choice, or cuBLAS where the rule's
            # blocks do not fit K) and cuBLAS (FP8 one-row layers always take the GEMV: the rule).
            baseline = row["default_us"] if row["default_us"] is not None else row["cublas_us"]
            limit = 0.97 * baseline if args.fp8 else min(0.97 * baseline, row["cublas_us"])
            if row["best_us"] < limit:
                table[SECTIONS[kernel]][shape] = row["best"]
        path.write_text(json.dumps(table, indent=1) + "\n")
        counts = ", ".join(f"{kernel} {len(table.get(section, {}))}" for kernel, section in SECTIONS.items())
        print(f"wrote {path} (shapes per kernel: {counts})")


if __name__ == "__main__":
    main()
