"""Writes the built-in tiny Qwen3 model (random weights, fixed seed, byte-identical every build).

Usage: python scripts/make_tiny_model.py --out DIR     (default: the cache directory the server uses)
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from paged_llm.models.tiny_model import default_tiny_model_dir, ensure_tiny_model, write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help=f"default: {default_tiny_model_dir()}")
    args = parser.parse_args()
    if args.out is None:
        out = ensure_tiny_model()
    else:
        write_tiny_model(args.out)
        out = args.out
    for path in sorted(p for p in out.iterdir() if not p.name.startswith(".")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"{digest}  {path.stat().st_size:>10}  {path}")


if __name__ == "__main__":
    main()
