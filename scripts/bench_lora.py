"""LoRA decode cost: the engine's decode step with every row on an adapter against the base model
alone, in one engine and one process, rounds alternating (issue 46's targets: batch 64 with 8
adapters mixed <= 1.15x base-only, batch 1 with an adapter <= 1.10x).

  python scripts/make_random_model.py --shape qwen3-0.6b --out /tmp/qwen3-0.6b-random
  python scripts/bench_lora.py --model /tmp/qwen3-0.6b-random --rank 16 --num-adapters 8 \\
      --batch-sizes 1,64 --json lora.json --plot lora.png
  On the CPU (smoke: the tiny model, float32):
  python scripts/bench_lora.py --model tiny-qwen3 --device cpu --dtype float32 --batch-sizes 1,4 \\
      --prompt-len 32 --new-tokens 8 --rounds 1

Random adapters (scripts/make_random_lora.py's) of `--rank` on every projection are written to a
temporary directory. Batch 1 runs one adapter; larger batches spread `--num-adapters` over the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from bench_decode import DecodeResult, run_batch, synchronize
from tqdm import tqdm

from paged_llm.config import CacheConfig, DeviceConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.lora.random_adapter import write_random_adapter
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.sampling_params import SamplingParams

TARGETS = {1: 1.10, 64: 1.15}  # batch size -> the largest adapter / base step ratio (issue 46)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="base / adapters pairs per batch size")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then trace this many decode steps of each batch size, base and with adapters, and "
        "print each kernel's time per step (on the CPU: each operator's)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model_dir = resolve_model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as scratch:
        names = [f"adapter{i}" for i in range(args.num_adapters)]
        modules = " ".join(
            f"{name}={write_random_adapter(model_dir, Path(scratch) / name, args.rank, seed=i)}"
            for i, name in enumerate(names)
        )
        config = EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len),
            cache=CacheConfig(),
            scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes), max_num_batched_tokens=16384),
            device=DeviceConfig(device=args.device),
            lora=LoRAConfig(lora_modules=modules, max_loras=args.num_adapters, max_lora_rank=args.rank),
        )
        engine = LLMEngine(config, show_progress=False)
        run_batch(engine, 2, 16, 4, 0, names)  # warm-up, adapters into their slots
        gc.collect()
        gc.freeze()
        rows = []
        with tqdm(total=len(batch_sizes) * args.rounds * 2, desc="decode runs") as progress:
            for batch_size in batch_sizes:
                lora_names = names[:1] if batch_size == 1 else names
                for round_index in range(args.rounds):
                    runs: dict[str, DecodeResult] = {}
                    for label, chosen in (("base", None), ("adapters", lora_names)):
                        runs[label] = run_batch(
                            engine, batch_size, args.prompt_len, args.new_tokens, round_index, chosen
                        )
                        progress.update()
                    rows.append(
                        {
                            "batch_size": batch_size,
                            "round": round_index,
                            "num_adapters": len(lora_names),
                            "base_ms_per_step": runs["base"].ms_per_step,
                            "adapters_ms_per_step": runs["adapters"].ms_per_step,
                            "ratio": runs["adapters"].ms_per_step / runs["base"].ms_per_step,
                            "runs": {label: asdict(run) for label, run in runs.items()},
                        }
                    )
        profiles = {}
        for batch_size in batch_sizes if args.profile_steps else []:
            lora_names = names[:1] if batch_size == 1 else names
            for label, chosen in (("base", None), ("adapters", lora_names)):
                profiles[f"batch {batch_size}, {label}"] = profile_decode(
                    engine, batch_size, args.prompt_len, chosen, args.profile_steps
                )
        engine.shutdown()
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\ncard: {card}; model {model_dir.name}; rank {args.rank}; context {args.prompt_len}")
    print(f"{'batch':>6}{'adapters':>10}{'round':>7}{'base ms':>10}{'LoRA ms':>10}{'ratio':>8}  target")
    failed = False
    for row in rows:
        target = TARGETS.get(row["batch_size"])
        verdict = ""
        if target is not None:
            ok = row["ratio"] <= target
            failed = failed or not ok
            verdict = f"<= {target:.2f} {'PASS' if ok else 'FAIL'}"
        print(
            f"{row['batch_size']:>6}{row['num_adapters']:>10}{row['round']:>7}{row['base_ms_per_step']:>10.3f}"
            f"{row['adapters_ms_per_step']:>10.3f}{row['ratio']:>8.3f}  {verdict}"
        )
    for key, kernels in profiles.items():
        total = sum(kernels.values())
        print(f"\n{key}: {total:.1f} us of kernels per decode step; the largest:")
        for name, us in sorted(kernels.items(), key=lambda item: -item[1])[:12]:
            print(f"  {us:9.1f} us  {name[:100]}")
    if args.json:
        result = {"card": card, "model": str(model_dir), "rows": rows, "kernel_us_per_step": profiles}
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        _plot(rows, args.plot, f"LoRA rank {args.rank} on {model_dir.name}, {card}")
    return 1 if failed else 0


def profile_decode(
    engine: LLMEngine, batch_size: int, prompt_len: int, lora_names: list[str] | None, num_steps: int
) -> dict[str, float]:
    """Microseconds per decode step of each kernel (torch.profiler, kernels inside CUDA graphs
    included; on the CPU each operator's own time) over `num_steps` steps of a batch past its
    prefill."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.core.device.torch_device.type == "cuda"
    for index in range(batch_size):
        lora_name = lora_names[index % len(lora_names)] if lora_names else None
        params = SamplingParams(
            temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True, lora_name=lora_name
        )
        engine.add_request(f"p{batch_size}-{lora_name}-{index}", [index + 1] * prompt_len, params)
    while any(r.num_output_tokens == 0 for r in engine.core.scheduler.sequences.values()):
        engine.step()
    synchronize(engine.core.device.torch_device)
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as trace:
        for _ in range(num_steps):
            engine.step()
        synchronize(engine.core.device.torch_device)
    while engine.has_unfinished_requests():
        engine.step()
    kernels: dict[str, float] = {}
    for event in trace.key_averages():
        own_us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if own_us > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + own_us / num_steps
    return kernels


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({row["batch_size"] for row in rows})
    fig, axis = plt.subplots(figsize=(6, 4))
    for key, label in (("base_ms_per_step", "base model"), ("adapters_ms_per_step", "with adapters")):
        means = [
            sum(r[key] for r in rows if r["batch_size"] == s) / sum(1 for r in rows if r["batch_size"] == s)
            for s in sizes
        ]
        axis.plot(sizes, means, "o-", label=label)
    axis.set(xscale="log", xlabel="batch size", ylabel="ms per decode step", title=title)
    axis.set_xticks(sizes, [str(s) for s in sizes])
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
