"""Where a decode step's time goes: Python (cProfile, by function) and the GPU (torch.profiler, by
kernel), for a batch of sequences that are all decoding.

  python scripts/profile_decode.py --model /tmp/qwen3-0.6b-random --batch-size 1 --steps 50
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

from paged_llm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="kernels are rank 0's")
    parser.add_argument("--all-reduce", default="auto", choices=["auto", "nccl"])
    parser.add_argument("--no-cprofile", action="store_true", help="the GPU profile only")
    args = parser.parse_args()
    config = EngineConfig(
        model=ModelConfig(model=str(resolve_model_dir(args.model)), max_model_len=args.max_model_len),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_size, 1), max_num_batched_tokens=16384),
        device=DeviceConfig(
            device="cuda",
            enable_cuda_graphs=not args.no_graphs,
            tensor_parallel_size=args.tensor_parallel_size,
            all_reduce=args.all_reduce,
        ),
    )
    engine = LLMEngine(config, show_progress=False)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 10, ignore_eos=True)
    for index in range(args.batch_size):
        engine.add_request(f"p{index}", [rng.randrange(100000) for _ in range(args.prompt_len)], params)
    for _ in range(10):  # prefill, then a few warm decode steps
        engine.step()
    torch.cuda.synchronize()

    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    print(f"plain: {(time.perf_counter() - start) / args.steps * 1e3:.3f} ms/step at batch {args.batch_size}")

    if not args.no_cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue()[-6000:])

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    engine.shutdown()  # stops tensor-parallel workers


if __name__ == "__main__":
    main()
