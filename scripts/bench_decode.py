"""Decode speed: per-token latency at batch 1, or a sweep over batch sizes, with achieved memory
bandwidth against the measured copy bandwidth of the device.

  Batch-1 latency (128-token prompt, 256 new tokens), with HF generate on the same card:
    python scripts/bench_decode.py --model /tmp/qwen3-0.6b-random --hf
  On the CPU (float32; HF generate in the same run and process, same threads):
    python scripts/bench_decode.py --model /tmp/qwen3-0.6b-f32 --device cpu --dtype float32 --hf \
        --new-tokens 64
  Sweep at 1k context (batch 1/16/64/256), PNG plot:
    python scripts/bench_decode.py --model /tmp/qwen3-0.6b-random --batch-sizes 1,16,64,256 \
        --prompt-len 1024 --new-tokens 64 --plot decode_sweep.png

Bytes per decode step = weights read once (every linear layer and the LM head; the embedding
lookup reads only a few rows) + the KV of every sequence's context. Bandwidth utilisation = bytes per
step / step time / copy bandwidth (a large device-to-device copy, read + write bytes).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from paged_llm.config import (
    TORCH_COMPILE_MODES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.gc_pauses import process_gc_pauses
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.sampling_params import SamplingParams
from paged_llm.testing.bench_workload import cpu_model_name


@dataclass
class DecodeResult:
    batch_size: int
    prompt_len: int
    new_tokens: int
    ms_per_step: float  # one decode step of the whole batch
    tokens_per_s: float
    bytes_per_step: float
    achieved_gb_per_s: float
    bandwidth_utilization: float  # vs the measured copy bandwidth
    gc_pause_ms: float = 0.0  # garbage-collection pauses inside the timed steps, in all


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gb_per_s(device: torch.device, num_bytes: int = 2 << 30) -> float:
    if device.type == "cpu":
        num_bytes = 512 << 20  # well beyond the caches; less time on a slow memory bus
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * num_bytes * repeats / elapsed / 1e9


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads from weights: all parameters except the embedding table, which is
    only gathered (a few rows) unless it doubles as the LM head."""
    model = engine.core.runner.model
    assert model is not None
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight
    if model.lm_head is not None:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """KV bytes per token on this device (under tensor parallelism: rank 0's KV heads)."""
    runner = engine.core.runner
    return runner.kv_bytes_per_block // runner.block_size_tokens


def run_batch(
    engine: LLMEngine,
    batch_size: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
    lora_names: list[str | None] | None = None,
) -> DecodeResult:
    """`lora_names`: request i runs with LoRA adapter lora_names[i % len] (scripts/bench_lora.py)."""
    rng = random.Random(seed)
    vocab = min(engine.info.vocab_size, len(engine.tokenizer))
    for index in range(batch_size):
        lora_name = lora_names[index % len(lora_names)] if lora_names else None
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, lora_name=lora_name)
        engine.add_request(
            f"d{batch_size}-{index}", [rng.randrange(vocab) for _ in range(prompt_len)], params
        )
    # Prefill (and the first token) first; time only the decode steps after it while the whole
    # batch runs. A long prompt batch prefills in several chunked steps, and the sequences done
    # first decode alongside the rest (256 x 1,024 tokens: up to 15 tokens ahead), so they also
    # finish first: the window ends at the first finished sequence, and the steps are counted as
    # launched (engine.core.num_steps). Counting the tokens still to come instead counted only the
    # last sequences' steps and timed the shrinking batch after the first ones finished.
    while any(r.num_output_tokens == 0 for r in engine.core.scheduler.sequences.values()):
        engine.step()
    device = engine.core.device.torch_device
    synchronize(device)  # a step launched ahead finishes here, outside the window
    first_step = engine.core.num_steps
    gc_before = process_gc_pauses()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if any(output.finished for output in engine.step()):
            break
    synchronize(device)
    elapsed = time.perf_counter() - start
    steps = engine.core.num_steps - first_step
    gc_pause_ms = process_gc_pauses().since(gc_before).pause_s_total * 1e3
    while engine.has_unfinished_requests():  # the rest of the batch, untimed
        engine.step()
    step_s = elapsed / steps
    mean_context = prompt_len + 1 + (new_tokens - 1) / 2
    step_bytes = weight_bytes(engine) + batch_size * mean_context * kv_bytes_per_token(engine)
    return DecodeResult(
        batch_size=batch_size,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        ms_per_step=step_s * 1e3,
        tokens_per_s=batch_size / step_s,
        bytes_per_step=step_bytes,
        achieved_gb_per_s=step_bytes / step_s / 1e9,
        bandwidth_utilization=0.0,
        gc_pause_ms=gc_pause_ms,
    )


def hf_ms_per_token(
    model_dir: Path, prompt_len: int, new_tokens: int, dtype: torch.dtype, device: str = "cuda"
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    ids = torch.randint(0, 1000, (1, prompt_len), device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        timings = []
        for count in (1, new_tokens):  # the difference removes the prefill
            synchronize(device)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=count, min_new_tokens=count, **kwargs)
            synchronize(device)
            timings.append(time.perf_counter() - start)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return (timings[1] - timings[0]) / (new_tokens - 1) * 1e3


def plot(results: list[DecodeResult], copy_gb_per_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.batch_size for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(sizes, [r.tokens_per_s for r in results], "o-")
    left.set(xscale="log", xlabel="batch size", ylabel="output tokens/s", title="decode throughput")
    right.plot(sizes, [r.achieved_gb_per_s for r in results], "o-", label="achieved")
    right.axhline(
        copy_gb_per_s, color="gray", linestyle="--", label=f"copy bandwidth {copy_gb_per_s:.0f} GB/s"
    )
    right.set(xscale="log", xlabel="batch size", ylabel="GB/s", title="bytes read per step / step time")
    right.legend()
    for axis in (left, right):
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--hf", action="store_true", help="also time HF generate at batch 1")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-triton-gemv", action="store_true", help="cuBLAS for one-row linear layers too (A/B of the GEMV)"
    )
    parser.add_argument(
        "--no-onednn-linear", action="store_true", help="CPU float32: F.linear (MKL) for every linear layer"
    )
    parser.add_argument(
        "--quantization", default="", choices=["", "fp8"], help="fp8: FP8 weights (per channel, at load)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an FP8 (e4m3) KV cache"
    )
    parser.add_argument(
        "--load-format",
        default="safetensors",
        choices=["safetensors", "dummy"],
        help="dummy: random weights drawn on the GPUs (a shape too large to write as a checkpoint)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs the model is split over; bytes and bandwidth are then rank 0's share, per GPU",
    )
    parser.add_argument(
        "--all-reduce",
        default="auto",
        choices=["auto", "nccl"],
        help="tensor parallelism's all-reduce (auto: one-shot over symmetric memory for small tensors)",
    )
    parser.add_argument(
        "--torch-compile",
        default="",
        choices=TORCH_COMPILE_MODES,
        help="torch.compile (Inductor) the decode step instead of our Triton elementwise/GEMV kernels",
    )
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    model_dir = resolve_model_dir(args.model)
    hf_ms = None
    if args.hf:  # first, while the whole card is free (the engine takes 90% of it for KV)
        hf_ms = hf_ms_per_token(
            model_dir, args.prompt_len, min(args.new_tokens, 64), config_dtype(args.dtype), args.device
        )
    config = EngineConfig(
        model=ModelConfig(
            model=str(model_dir),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            quantization=args.quantization,
        ),
        cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes), max_num_batched_tokens=16384),
        device=DeviceConfig(
            device=args.device,
            enable_triton_gemv=not args.no_triton_gemv,
            enable_onednn_linear=not args.no_onednn_linear,
            tensor_parallel_size=args.tensor_parallel_size,
            all_reduce=args.all_reduce,
            torch_compile=args.torch_compile,
        ),
    )
    engine = LLMEngine(config, show_progress=False)
    card = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    copy_gb_per_s = copy_bandwidth_gb_per_s(engine.core.device.torch_device)
    run_batch(engine, 1, 16, 8, args.seed)  # warm-up
    # As the served engine core does (engine/engine_core/process.py): what lives as long as the process
    # stays out of later collections, so a full collection walks only what the steps create. The
    # GC column reports the pauses that still fall inside the timed steps.
    gc.collect()
    gc.freeze()
    results = []
    for batch_size in batch_sizes:
        result = run_batch(engine, batch_size, args.prompt_len, args.new_tokens, args.seed)
        result.bandwidth_utilization = result.achieved_gb_per_s / copy_gb_per_s
        results.append(result)
    print(
        f"\ncard: {card}; copy bandwidth {copy_gb_per_s:.0f} GB/s; "
        f"model {model_dir.name} ({engine.info.dtype}); tensor parallel size {args.tensor_parallel_size}"
    )
    weights_gb = weight_bytes(engine) / 1e9
    print(f"weights read per step: {weights_gb:.3f} GB; KV per token {kv_bytes_per_token(engine)} B")
    print(
        f"{'batch':>6}{'prompt':>8}{'new':>6}{'ms/step':>10}{'tok/s':>11}{'GB/s':>9}{'of copy BW':>12}"
        f"{'GC ms':>8}"
    )
    for r in results:
        print(
            f"{r.batch_size:>6}{r.prompt_len:>8}{r.new_tokens:>6}{r.ms_per_step:>10.3f}{r.tokens_per_s:>11.0f}"
            f"{r.achieved_gb_per_s:>9.0f}{r.bandwidth_utilization:>11.1%}{r.gc_pause_ms:>8.1f}"
        )
    if hf_ms is not None:
        ratio = hf_ms / results[0].ms_per_step if results[0].batch_size == 1 else float("nan")
        print(f"HF transformers generate, batch 1: {hf_ms:.2f} ms/token (paged_llm {ratio:.1f}x faster)")
    if args.plot:
        plot(results, copy_gb_per_s, args.plot, f"{model_dir.name} on {card}, context {args.prompt_len}")
    if args.json:
        payload = {
            "card": card,
            "copy_gb_per_s": copy_gb_per_s,
            "hf_ms_per_token": hf_ms,
            "tensor_parallel_size": args.tensor_parallel_size,
            "all_reduce": args.all_reduce,
            "one_shot_all_reduce": engine.core.runner.parallel.uses_one_shot,
        }
        payload["results"] = [asdict(r) for r in results]
        args.json.write_text(json.dumps(payload, indent=2))
    engine.shutdown()  # stops tensor-parallel workers


def cpu_name() -> str:
    return f"{cpu_model_name() or 'cpu'}, {torch.get_num_threads()} torch threads"


def config_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "auto" else getattr(torch, name)


if __name__ == "__main__":
    main()
