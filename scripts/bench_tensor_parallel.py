"""Decode time per token at tensor parallel sizes 1, 2, 4 ... on one host: the issue's TP targets.

Runs `scripts/bench_decode.py` once per size (each in its own process, so every run has the whole
set of GPUs to itself), then prints each size's ms per step and its ratio to size 1, checks the
targets and draws the ratio. Example (Llama-3-8B shape on a 4-GPU host):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python scripts/bench_tensor_parallel.py --model /tmp/models/llama3-8b --sizes 1,2,4 \\
        --batch-sizes 1,16 --json docs/results/tp_llama8b.json --plot docs/results/tp_llama8b.png

Llama-3-70B (141 GB in bfloat16: no checkpoint is written, each rank draws its shard on its GPU):

    python scripts/make_random_model.py --shape llama3-70b --out /tmp/models/llama3-70b --config-only
    python scripts/bench_tensor_parallel.py --model /tmp/models/llama3-70b --load-format dummy --sizes 4

Targets (issue "Several GPUs"): Llama-3-8B batch 1, size 2 <= 0.6x size 1's time per token;
Llama-3-70B batch 1 at size 4 <= 15 ms per token (checked by --max-ms-per-token).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_RATIO = {2: 0.6}  # tensor parallel size -> at most this share of size 1's batch-1 time
HERE = Path(__file__).resolve().parent


def run_size(args: argparse.Namespace, size: int, out: Path) -> dict:
    command = [sys.executable, str(HERE / "bench_decode.py"), "--model", args.model]
    command += ["--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len)]
    command += ["--new-tokens", str(args.new_tokens), "--dtype", args.dtype]
    command += ["--max-model-len", str(args.max_model_len), "--tensor-parallel-size", str(size)]
    command += ["--load-format", args.load_format, "--all-reduce", args.all_reduce, "--json", str(out)]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument("--all-reduce", default="auto", choices=["auto", "nccl"])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--max-ms-per-token", type=float, default=None, help="batch-1 target of the largest size"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for size in sizes:
            runs[size] = run_size(args, size, Path(scratch) / f"tp{size}.json")
    base = {r["batch_size"]: r["ms_per_step"] for r in runs[sizes[0]]["results"]}
    card = runs[sizes[0]]["card"]
    print(f"\n{args.model} on {card}; all_reduce {args.all_reduce}; ratio against size {sizes[0]}")
    print(f"{'TP':>4}{'batch':>7}{'ms/step':>10}{'ratio':>8}{'target':>9}")
    rows = []
    failed = []
    for size in sizes:
        for r in runs[size]["results"]:
            ratio = r["ms_per_step"] / base[r["batch_size"]]
            target = TARGET_RATIO.get(size) if r["batch_size"] == 1 else None
            verdict = "" if target is None else (f"<={target}" + (" ok" if ratio <= target else " MISSED"))
            if target is not None and ratio > target:
                failed.append(f"TP {size} batch 1: {ratio:.3f}x > {target}x")
            print(f"{size:>4}{r['batch_size']:>7}{r['ms_per_step']:>10.3f}{ratio:>8.3f}{verdict:>9}")
            one_shot = runs[size].get("one_shot_all_reduce", False)
            rows.append(
                {"tensor_parallel_size": size, **r, "ratio_to_base": ratio, "one_shot_all_reduce": one_shot}
            )
    if args.max_ms_per_token is not None:
        largest = max(sizes)
        batch_one = [r for r in runs[largest]["results"] if r["batch_size"] == 1]
        if batch_one and batch_one[0]["ms_per_step"] > args.max_ms_per_token:
            failed.append(
                f"TP {largest} batch 1: {batch_one[0]['ms_per_step']:.2f} ms > {args.max_ms_per_token} ms"
            )
    if args.json:
        payload = {"card": card, "model": args.model, "all_reduce": args.all_reduce, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 4))
        for batch in sorted(base):
            points = [
                (row["tensor_parallel_size"], row["ms_per_step"])
                for row in rows
                if row["batch_size"] == batch
            ]
            axis.plot(*zip(*points), marker="o", label=f"batch {batch}")
        axis.set_xlabel("tensor parallel size (GPUs)")
        axis.set_ylabel("ms per decode step")
        axis.set_xticks(sizes)
        axis.set_title(f"{Path(args.model).name} on {card}", fontsize=9)
        axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
    print("targets: " + ("all met" if not failed else "; ".join(failed)))


if __name__ == "__main__":
    main()
