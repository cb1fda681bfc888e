"""Writes a random-weight checkpoint in the shape of a real model (no downloads), e.g. on a GPU host:

python scripts/make_random_model.py --shape qwen3-0.6b --out /tmp/qwen3-0.6b-random
python scripts/make_random_model.py --shape llama3-8b --out /tmp/llama3-8b-random --device cuda
python scripts/make_random_model.py --shape qwen3-0.6b --quantization fp8-block --out /tmp/qwen3-0.6b-fp8

--quantization writes the projections in a published FP8 layout, with its config and scale tensors:
fp8-block (Qwen3-*-FP8: 128x128 blocks, weight_scale_inv), fp8-channel (compressed-tensors
FP8-dynamic: per-channel weight_scale) or fp8-tensor (compressed-tensors static per-tensor).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paged_llm.models.fp8 import LAYOUTS
from paged_llm.models.random_model import SHAPES, write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is faster)")
    parser.add_argument(
        "--config-only", action="store_true", help="no weights: for an engine with load_format dummy"
    )
    parser.add_argument("--quantization", choices=LAYOUTS, help="write the projections in this FP8 layout")
    args = parser.parse_args()
    print(
        write_random_model(
            args.out,
            args.shape,
            args.dtype,
            args.seed,
            args.device,
            with_weights=not args.config_only,
            quantization=args.quantization,
        )
    )


if __name__ == "__main__":
    main()
