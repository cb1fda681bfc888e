"""Sweeps the launch settings of the one-row GEMV kernel (layers/fused_ops.py) over the weight shapes
of the models we serve and their tensor-parallel shards, and writes the fastest per shape: the table
layers/gemv_tuning.py reads (gemv_tables/<card>.json, or PAGED_LLM_GEMV_TABLE).

Each timing is a CUDA graph of back-to-back GEMVs over enough copies of the weight that none is
still in L2 when it comes round again (as in a model, where every layer has its own weights);
cuBLAS (F.linear) and the default settings are timed the same way, and every GEMV result is
checked against cuBLAS.

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

from paged_llm.layers.fused_ops import _gemv_kernel
from paged_llm.layers.gemv_tuning import GemvConfig, default_gemv_config, table_file_name
from paged_llm.layers.parallel import ShardPlan
from paged_llm.models.hf_config import load_model_spec
from paged_llm.models.random_model import SHAPES

MIN_CALLS_PER_GRAPH = 32
L2_FLUSH_BYTES = 256 * 1024 * 1024  # rotate over at least this much weight


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


def candidates(k: int) -> list[GemvConfig]:
    configs = []
    grid = itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (2, 3, 4))
    for block_n, block_k, warps, stages in grid:
        if k % block_k == 0 and block_n * block_k <= 8192:
            configs.append(GemvConfig(block_n, block_k, warps, stages))
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


def sweep_shape(n: int, k: int, device: torch.device) -> dict:
    weight_bytes = n * k * 2
    num_copies = max(2, -(-L2_FLUSH_BYTES // weight_bytes))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(num_copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
    reference = F.linear(x, weights[0]).float()

    def cublas(i: int) -> None:
        torch.mm(x, weights[i].t(), out=out)

    def gemv(config: GemvConfig):
        def run(i: int) -> None:
            _gemv_kernel[(triton.cdiv(n, config.block_n),)](
                x, weights[i], out, n, k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                num_warps=config.num_warps, num_stages=config.num_stages,
            )  # fmt: skip

        return run

    results = {"cublas_us": time_us(cublas, num_copies)}
    timings = []
    for config in candidates(k):
        out.fill_(float("nan"))  # a launch that writes nothing must not pass on the last result
        gemv(config)(0)
        torch.cuda.synchronize()
        if not torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"{n}x{k} {config}: wrong result")
        timings.append((time_us(gemv(config), num_copies), config))
    default = default_gemv_config(n, k)
    results["default_us"] = next(us for us, c in timings if c == default) if default.fits(k) else None
    best_us, best = min(timings, key=lambda item: item[0])
    results.update(best_us=best_us, best=[best.block_n, best.block_k, best.num_warps, best.num_stages])
    results["best_tb_per_s"] = weight_bytes / best_us / 1e6
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
    parser.add_argument("--json", type=Path, help="every timing")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    card = torch.cuda.get_device_name(device)
    shapes: dict[tuple[int, int], list[str]] = {}
    for item in args.models.split(","):
        shape, world_size = item.split(":")
        for name, n, k in model_shapes(shape, int(world_size)):
            shapes.setdefault((n, k), []).append(f"{shape} TP{world_size} {name}")
    rows = {}
    for (n, k), names in tqdm(sorted(shapes.items()), desc="shapes", file=sys.stderr):
        rows[f"{n},{k}"] = {"used_by": names, **sweep_shape(n, k, device)}
    print(f"{card}: one-row GEMV, bf16, us per call (weights not in L2)")
    header = f"{'N x K':>14}{'cuBLAS':>9}{'default':>9}{'best':>8}{'TB/s':>7}"
    print(header + "  best [BN, BK, warps, stages]  used by")
    for key, row in rows.items():
        default = f"{row['default_us']:.1f}" if row["default_us"] is not None else "-"
        print(
            f"{key.replace(',', ' x '):>14}{row['cublas_us']:>9.1f}{default:>9}{row['best_us']:>8.1f}"
            f"{row['best_tb_per_s']:>7.2f}  {row['best']!s:<28} {', '.join(row['used_by'])}"
        )
    if args.json:
        args.json.write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    if args.write:
        path = args.write
        if path.name == "auto" or path.is_dir():
            path = (path.parent if path.name == "auto" else path) / table_file_name(card)
        table = {"device": card, "measured_by": "scripts/bench_gemv.py", "configs": {}}
        for key, row in rows.items():
            # Only where it beats the rule by 3% (the rule's own choice, or cuBLAS where the rule's
            # blocks do not fit K) and cuBLAS.
            baseline = row["default_us"] if row["default_us"] is not None else row["cublas_us"]
            if row["best_us"] < min(0.97 * baseline, row["cublas_us"]):
                table["configs"][key] = row["best"]
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {len(table['configs'])} shapes to {path}")


if __name__ == "__main__":
    main()
