"""Writes a random-weight PEFT LoRA adapter for a base checkpoint (tests and benchmarks, no downloads):

python scripts/make_random_lora.py --base /tmp/qwen3-0.6b-random --rank 16 --out /tmp/lora-a
python scripts/make_random_lora.py --base DIR --rank 8 --targets q_proj,v_proj --seed 1 --out /tmp/lora-b
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paged_llm.lora.adapter import TARGET_MODULES
from paged_llm.lora.random_adapter import write_random_adapter


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="the base model's checkpoint directory")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, help="lora_alpha (default: 2 x rank)")
    parser.add_argument("--rslora", action="store_true", help="use_rslora: scaling alpha / sqrt(rank)")
    parser.add_argument(
        "--targets", default=",".join(TARGET_MODULES), help="comma-separated projections to adapt"
    )
    args = parser.parse_args()
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown:
        parser.error(f"--targets: {', '.join(unknown)} not in {', '.join(TARGET_MODULES)}")
    print(
        write_random_adapter(
            args.base, args.out, args.rank, args.seed, args.alpha, targets, use_rslora=args.rslora
        )
    )


if __name__ == "__main__":
    main()
