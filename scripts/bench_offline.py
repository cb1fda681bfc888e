"""Offline throughput: many requests through the paged_llm engine vs HF transformers, same model,
same machine, one run. Prints output tokens/s of both and the ratio.

Workload (nano-vllm's, scaled by flags): random prompt token ids and output lengths drawn uniformly
from the given ranges, ignore_eos so every request produces exactly its output length.

  CPU, built-in tiny model (the default):
    .venv/bin/python scripts/bench_offline.py
  GPU, Qwen3-0.6B shape with random weights (see scripts/make_random_model.py):
    python scripts/bench_offline.py --model /tmp/qwen3-0.6b-random --num-requests 256 \
        --input-len 100:1024 --output-len 100:1024 --hf-num-requests 32

The HF baseline uses transformers' continuous-batching API (`generate_batch`) when available, else
padded batched `generate`. `--hf-num-requests` runs HF on the first N requests only (its tokens/s is
still a rate over the same distribution); the ratio compares rates.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from paged_llm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from paged_llm.engine.core_client import InProcessCoreClient
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.models.hf_config import load_model_spec
from paged_llm.runner.device import Device
from paged_llm.sampling_params import SamplingParams
from paged_llm.testing.bench_workload import random_workload
from paged_llm.tokenizer.hf_tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import engine_figures, format_step_means, step_means

# Upper ends of the batch-size buckets the time profile adds up (running sequences after a step).
BATCH_BUCKETS = (1, 8, 32, 64, 128, 192, 256, 1 << 30)


@dataclass
class RunResult:
    name: str
    num_requests: int
    num_output_tokens: int
    elapsed_s: float
    # Per batch-size bucket ("<=64"): [steps, seconds, output tokens]; the engine run only.
    batch_profile: dict[str, list[float]] | None = None
    step_means: dict[str, dict[str, float | None]] | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's and the engine's settings; shared with scripts/profile_offline.py."""
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", default="16:256", help="uniform range, e.g. 100:1024")
    parser.add_argument("--output-len", default="16:128", help="uniform range, e.g. 100:1024")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the engine's requests sample at this temperature (0: greedy; the HF baseline stays greedy)",
    )
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1: off)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=0, help="0: the checkpoint's")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=0)
    parser.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default="auto",
        help="launch step N+1 before step N's tokens are on the host (auto: on for accelerators)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    parser.add_argument("--all-reduce", default="auto", choices=["auto", "nccl"])
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
        help="dummy: random weights drawn on the GPUs (no checkpoint; implies --hf none)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=str(resolve_model_dir(args.model)),
            dtype=args.dtype,
            max_model_len=args.max_model_len or None,
            load_format=args.load_format,
            quantization=args.quantization,
        ),
        cache=CacheConfig(num_blocks=args.num_kv_blocks or None, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=args.async_scheduling,
        ),
        device=DeviceConfig(
            device=args.device, tensor_parallel_size=args.tensor_parallel_size, all_reduce=args.all_reduce
        ),
    )


def make_workload(args: argparse.Namespace, vocab_limit: int) -> list[tuple[list[int], int]]:
    jobs = random_workload(args.num_requests, args.input_len, args.output_len, vocab_limit, args.seed)
    return [(job.prompt_token_ids, job.num_output_tokens) for job in jobs]


def run_engine(
    engine: LLMEngine,
    workload: list[tuple[list[int], int]],
    show_progress: bool,
    sampling: SamplingParams | None = None,
) -> RunResult:
    """`sampling`: every request's parameters but max_tokens (default greedy)."""
    sampling = sampling or SamplingParams(temperature=0.0)
    for index, (prompt, num_output) in enumerate(workload):
        params = replace(sampling, max_tokens=num_output, ignore_eos=True, seed=index)
        engine.add_request(f"bench-{index}", prompt, params)
    total = sum(n for _, n in workload)
    produced = 0
    # In process mode the core steps in its own process: no batch sizes to read here.
    in_process = isinstance(engine.client, InProcessCoreClient)
    running = engine.core.scheduler.running if in_process else None
    profile = {_bucket_name(upper): [0, 0.0, 0] for upper in BATCH_BUCKETS}
    figures_before = engine_figures(engine)
    _synchronize(engine)
    start = last = time.perf_counter()
    with tqdm(total=total, desc="paged_llm", unit="tok", disable=not show_progress) as bar:
        while engine.has_unfinished_requests():
            new = 0
            for output in engine.step():
                new += sum(len(s.token_ids) for s in output.sequences)
            # The step just returned ran with about this many rows (the next one is in flight).
            now = time.perf_counter()
            if running is not None:
                entry = profile[batch_bucket(len(running))]
                entry[0] += 1
                entry[1] += now - last
                entry[2] += new
            last = now
            produced += new
            bar.update(new)
    _synchronize(engine)
    elapsed = time.perf_counter() - start
    assert produced == total, f"engine produced {produced} tokens, expected {total}"
    means = step_means(figures_before, engine_figures(engine))
    profile = {name: entry for name, entry in profile.items() if entry[0]}
    return RunResult("paged_llm", len(workload), produced, elapsed, profile or None, means)


def _synchronize(engine: LLMEngine) -> None:
    """In process mode every token counted has left the device already."""
    if isinstance(engine.client, InProcessCoreClient):
        engine.core.device.synchronize()


def batch_bucket(num_rows: int) -> str:
    """The BATCH_BUCKETS bucket a step of `num_rows` rows counts in ("<=64")."""
    return _bucket_name(next(upper for upper in BATCH_BUCKETS if num_rows <= upper))


def _bucket_name(upper: int) -> str:
    return "any" if upper >= 1 << 30 else f"<={upper}"


def print_batch_profile(result: RunResult) -> None:
    """Where the run's time went by batch size: what a faster decode at that size could win."""
    if result.batch_profile:
        print(f"time by running sequences ({result.name}):")
        print(f"{'batch':>8}{'steps':>8}{'seconds':>9}{'share':>8}{'tokens':>9}{'tok/s':>10}")
        for name, (num_steps, seconds, num_tokens) in result.batch_profile.items():
            share = seconds / result.elapsed_s
            rate = num_tokens / seconds if seconds else 0.0
            print(
                f"{name:>8}{int(num_steps):>8}{seconds:>9.2f}{share:>8.1%}{int(num_tokens):>9}{rate:>10.0f}"
            )
    if result.step_means:
        print(f"engine steps: {format_step_means(result.step_means)}")


def run_hf(
    model_dir: Path, workload, device: torch.device, dtype: torch.dtype, mode: str, batch_size: int
) -> RunResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    if mode in ("auto", "cb") and hasattr(model, "continuous_batching_context_manager"):
        return _run_hf_continuous_batching(model, workload, device)
    return _run_hf_padded_generate(model, workload, device, batch_size)


def _run_hf_continuous_batching(model, workload, device: torch.device) -> RunResult:
    """transformers' continuous batching, each request with its own output length."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in workload),
        max_generated_length=max(n for _, n in workload),
        num_requests=len(workload),
    )
    total = sum(n for _, n in workload)
    with (
        torch.no_grad(),
        model.continuous_batching_context_manager(
            generation_config=config, workload_hints=hints, block=True, timeout=10
        ) as manager,
    ):
        _sync(device)
        start = time.perf_counter()
        for index, (prompt, num_output) in enumerate(workload):
            manager.add_request(input_ids=prompt, request_id=f"hf-{index}", max_new_tokens=num_output)
        produced = 0
        with tqdm(total=len(workload), desc="hf continuous batching", unit="req") as bar:
            for _ in range(len(workload)):
                result = None
                while result is None:
                    result = manager.get_result(timeout=1)
                produced += len(result.generated_tokens)
                bar.update(1)
        _sync(device)
        elapsed = time.perf_counter() - start
    assert produced == total, f"HF produced {produced} tokens, expected {total}"
    return RunResult("hf-continuous-batching", len(workload), produced, elapsed)


def _run_hf_padded_generate(model, workload, device: torch.device, batch_size: int) -> RunResult:
    """Padded batched `generate`, longest prompts first; only each request's own tokens count."""
    order = sorted(range(len(workload)), key=lambda i: -len(workload[i][0]))
    _sync(device)
    start = time.perf_counter()
    produced = 0
    for begin in tqdm(range(0, len(order), batch_size), desc="hf generate", unit="batch"):
        batch = [workload[i] for i in order[begin : begin + batch_size]]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        num_new = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                pad_token_id=0,
            )
        produced += sum(n for _, n in batch)
    _sync(device)
    return RunResult("hf-generate-padded", len(workload), produced, time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    parser.add_argument("--hf", choices=["auto", "cb", "generate", "none"], default="auto")
    parser.add_argument(
        "--hf-num-requests", type=int, default=0, help="HF runs the first N requests (0 = all)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument(
        "--core-mode",
        choices=["auto", "inprocess", "process"],
        default="auto",
        help="process: the engine core steps in its own process, output processing in this one (as "
        "serving runs it, and vLLM's LLM class); auto: process on an accelerator, inprocess on a CPU, "
        "where output processing in a second process only takes cores from the forward",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    config = engine_config(args)
    model_dir = resolve_model_dir(args.model)
    spec = load_model_spec(model_dir)
    vocab_limit = min(spec.vocab_size, len(load_tokenizer(model_dir)))
    workload = make_workload(args, vocab_limit)
    device = Device.resolve(args.device)
    dtype = device.model_dtype(args.dtype, spec.checkpoint_dtype)
    hf_result = None
    # HF first, while the whole device is free (the engine takes 90% of it for KV).
    if args.hf != "none" and args.load_format != "dummy":
        subset = workload[: args.hf_num_requests] if args.hf_num_requests else workload
        hf_result = run_hf(model_dir, subset, device.torch_device, dtype, args.hf, args.hf_batch_size)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    engine = LLMEngine(config, show_progress=not args.no_progress, core_mode=args.core_mode)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    warmup = [(p[:32], 8) for p, _ in workload[: min(8, len(workload))]]
    run_engine(engine, warmup, show_progress=False, sampling=sampling)
    ours = run_engine(engine, workload, show_progress=not args.no_progress, sampling=sampling)
    results = [ours] + ([hf_result] if hf_result is not None else [])

    card = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available() and args.device != "cpu"
        else platform.processor() or "cpu"
    )
    threads = torch.get_num_threads()
    print(f"\nmachine: {platform.node()} ({card}), torch {torch.__version__}, {threads} CPU threads")
    print(
        f"workload: {args.num_requests} requests, input {args.input_len}, output {args.output_len}; "
        f"engine core {engine.core_mode}; "
        + (
            f"sampling temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p}"
            if args.temperature > 0
            else "greedy"
        )
    )
    if args.tensor_parallel_size > 1:
        one_shot = (
            engine.core.runner.parallel.uses_one_shot
            if engine.core_mode == "inprocess"
            else "not known here (the core runs in its own process; --core-mode inprocess shows it)"
        )
        print(f"tensor parallel size {args.tensor_parallel_size}, one-shot all-reduce {one_shot}")
    print(f"{'run':<24}{'requests':>10}{'out tokens':>12}{'seconds':>10}{'tok/s':>12}")
    for result in results:
        print(
            f"{result.name:<24}{result.num_requests:>10}{result.num_output_tokens:>12}"
            f"{result.elapsed_s:>10.2f}{result.output_tokens_per_s:>12.1f}"
        )
    print_batch_profile(ours)
    if len(results) == 2:
        ratio = ours.output_tokens_per_s / results[1].output_tokens_per_s
        print(f"ratio paged_llm / {results[1].name}: {ratio:.2f}x")
    if args.json:
        payload = {
            "argv": sys.argv,
            "card": card,
            "tensor_parallel_size": args.tensor_parallel_size,
            "core_mode": engine.core_mode,
            "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    engine.shutdown()  # stops tensor-parallel workers


if __name__ == "__main__":
    main()
