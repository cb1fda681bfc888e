"""The sampler's time per step on [B, V] logits, by sampling parameters: greedy, top-k, top-p alone
(a sort of the vocabulary), and top-k + top-p on the rows' top tokens (the window path) against the
same parameters through the sort.

    python scripts/bench_sampler.py --device cuda --batch-sizes 1,64,256,1024 --json sampler.json

Every row of a case has the same parameters, its own seed; the logits are random normal times 3
(a spread like a model's). Times are the median of `--repeats` calls, device synchronised.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from paged_llm.runner.device import Device
from paged_llm.sampling import sampler as sampler_module
from paged_llm.sampling.sampler import Sampler, SamplingMetadata, SamplingRow
from paged_llm.sampling_params import SamplingParams

CASES = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "temperature": (SamplingParams(temperature=0.7), None),
    "top_k 20": (SamplingParams(temperature=0.7, top_k=20), None),
    "top_p 0.95 (sort)": (SamplingParams(temperature=0.7, top_p=0.95), None),
    "top_k 20 + top_p 0.95 (window)": (SamplingParams(temperature=0.6, top_k=20, top_p=0.95), None),
    "top_k 20 + top_p 0.95 (sort)": (SamplingParams(temperature=0.6, top_k=20, top_p=0.95), 0),
}


def time_case(
    params: SamplingParams,
    window_tokens: int | None,
    num_rows: int,
    vocab_size: int,
    device: Device,
    repeats: int,
) -> float:
    """Median ms of one Sampler call; `window_tokens` 0 sends top-p rows through the sort."""
    saved = sampler_module.TOP_P_WINDOW_TOKENS
    if window_tokens is not None:
        sampler_module.TOP_P_WINDOW_TOKENS = window_tokens
    try:
        rows = [
            SamplingRow(params, seed=i, prompt_token_ids=(), output_token_ids=()) for i in range(num_rows)
        ]
        metadata = SamplingMetadata.build(rows, vocab_size, device.torch_device)
    finally:
        sampler_module.TOP_P_WINDOW_TOKENS = saved
    generator = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(num_rows, vocab_size, generator=generator) * 3).to(device.torch_device)
    sampler = Sampler()
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        device.synchronize()
        start = time.perf_counter()
        sampler(logits, metadata)
        device.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--vocab-size", type=int, default=151_936, help="Qwen3's")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = Device.resolve(args.device)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    card = torch.cuda.get_device_name() if device.is_cuda else platform.processor() or "cpu"
    print(f"{card}, torch {torch.__version__}, vocabulary {args.vocab_size}")
    results = []
    with tqdm(total=len(CASES) * len(batch_sizes), desc="cases", unit="case") as bar:
        for name, (params, window_tokens) in CASES.items():
            for num_rows in batch_sizes:
                ms = time_case(params, window_tokens, num_rows, args.vocab_size, device, args.repeats)
                results.append({"case": name, "num_rows": num_rows, "ms": ms})
                bar.update(1)
    print(f"{'case':<34}" + "".join(f"{f'B={b} ms':>12}" for b in batch_sizes))
    for name in CASES:
        times = {r["num_rows"]: r["ms"] for r in results if r["case"] == name}
        print(f"{name:<34}" + "".join(f"{times[b]:>12.3f}" for b in batch_sizes))
    if args.json:
        args.json.write_text(
            json.dumps({"card": card, "vocab_size": args.vocab_size, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
