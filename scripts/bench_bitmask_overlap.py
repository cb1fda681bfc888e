"""Does the grammar bitmask fill run under the engine thread's work? CPU only, seconds.

The core starts a launched-ahead step's bitmask on StepBitmask's fill threads, then publishes the
step before and schedules the next one (pure Python), then waits for the fill (`finish`). This
reproduces that: 64 matchers of bench_structured's 10-property schema at assorted depths (Qwen's
vocabulary, from the built-in tiny model), a fill started, N ms of Python on this thread, then
finish(); it prints how long finish() still waited, at Python's default GIL switch interval and at
the one the fill threads set (structured_output/grammar.py FILL_SWITCH_INTERVAL_S).

    python scripts/bench_bitmask_overlap.py [--python-ms 2] [--rows 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structured import ten_property_schema

from paged_llm.models.tiny_model import ensure_tiny_model
from paged_llm.sampling.token_bitmask import apply_token_bitmask_torch_
from paged_llm.structured_output import grammar as grammar_module
from paged_llm.structured_output.grammar import SequenceGrammar, StepBitmask
from paged_llm.structured_output.tokenizer_info import build_tokenizer_info

VOCAB_SIZE = 151936  # Qwen3's logits width
EOS = 151645


@dataclass
class Row:
    grammar: SequenceGrammar


def _rows(num_rows: int, seed: int) -> list[Row]:
    info = build_tokenizer_info(ensure_tiny_model(), VOCAB_SIZE, [EOS])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(ten_property_schema()))
    rng = random.Random(seed)
    scratch = torch.empty(xgrammar.get_bitmask_shape(1, VOCAB_SIZE), dtype=torch.int32)
    rows = []
    for _ in range(num_rows):
        grammar = SequenceGrammar(compiled)
        for _ in range(rng.randint(1, 150)):
            grammar.matcher.fill_next_token_bitmask(scratch, 0)
            allowed = apply_token_bitmask_torch_(torch.zeros(1, VOCAB_SIZE), scratch)[0].isfinite()
            allowed[EOS] = False
            grammar.accept_token(rng.choice(allowed.nonzero().view(-1).tolist()))
        rows.append(Row(grammar))
    return rows


def _python_work(milliseconds: float) -> None:
    end = time.perf_counter() + milliseconds / 1e3
    total = 0
    while time.perf_counter() < end:
        for value in range(200):
            total += value


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python-ms", type=float, default=2.0, help="Python work between start and finish")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    rows = _rows(args.rows, seed=0)
    bitmask = StepBitmask(args.rows, VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    started = time.perf_counter()
    for _ in range(20):
        bitmask.fill(rows)
    print(f"fill on this thread: {(time.perf_counter() - started) / 20 * 1e3:.3f} ms for {args.rows} rows")
    try:
        for interval_s in (0.005, grammar_module.FILL_SWITCH_INTERVAL_S):
            bitmask.finish(bitmask.start(rows))  # the threads exist: start() lowers the interval once
            sys.setswitchinterval(interval_s)
            waits_ms = []
            for _ in range(args.repeats):
                pending = bitmask.start(rows)
                _python_work(args.python_ms)
                started = time.perf_counter()
                bitmask.finish(pending)
                waits_ms.append((time.perf_counter() - started) * 1e3)
            waits_ms.sort()
            p50, p90 = waits_ms[len(waits_ms) // 2], waits_ms[len(waits_ms) * 9 // 10]
            print(
                f"switch interval {interval_s * 1e3:.1f} ms: finish() waited p50 {p50:.3f} ms, "
                f"p90 {p90:.3f} ms after {args.python_ms:g} ms of Python"
            )
    finally:
        bitmask.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
