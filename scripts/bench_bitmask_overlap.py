"""Does the grammar bitmask fill run under the engine thread's work? CPU only, seconds.

The core starts a launched-ahead step's bitmask on StepBitmask's fill thread, then publishes the
step before and schedules the next one (pure Python), then waits for the fill (`finish`). This
reproduces that: 64 matchers of bench_structured's 10-property schema at assorted depths (Qwen's
vocabulary, from the built-in tiny model), a fill started, N ms of Python on this thread, then
finish(); it prints how long finish() still waited, at Python's default GIL switch interval and at
the one the fill thread sets (structured_output/grammar.py FILL_SWITCH_INTERVAL_S).

    python scripts/bench_bitmask_overlap.py [--python-ms 2] [--rows 64] [--threads 1,2,4] [--accept]

`--accept` also hands the fill the step's tokens (the grammars take them first, on the fill thread,
as the engine does for a launched-ahead step) against taking them on this thread before start(), at
switch intervals of 0.2 ms and StepBitmask's. `--threads` also times the fill split over that many
Python fill threads (one xgrammar call each),
and StepBitmask's one call over that many of xgrammar's own threads (MAX_XGRAMMAR_THREADS), with
this thread blocked at once (the fill's wall time) and after --python-ms of Python (what finish()
still waits).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xgrammar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structured import ten_property_schema

from paged_llm.models.tiny_model import ensure_tiny_model
from paged_llm.structured_output import grammar as grammar_module
from paged_llm.structured_output.grammar import SequenceGrammar, StepBitmask
from paged_llm.structured_output.tokenizer_info import build_tokenizer_info
from paged_llm.testing.grammar_walk import allowed_token_ids, walk_randomly

VOCAB_SIZE = 151936  # Qwen3's logits width
EOS = 151645


@dataclass
class Row:
    grammar: SequenceGrammar
    is_finished: bool = False


def _rows(num_rows: int, seed: int) -> list[Row]:
    info = build_tokenizer_info(ensure_tiny_model(), VOCAB_SIZE, [EOS])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(ten_property_schema()))
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        grammar = SequenceGrammar(compiled)
        walk_randomly(grammar, rng.randint(1, 150), rng, VOCAB_SIZE, EOS)
        rows.append(Row(grammar))
    return rows


def _python_work(milliseconds: float) -> None:
    end = time.perf_counter() + milliseconds / 1e3
    total = 0
    while time.perf_counter() < end:
        for value in range(200):
            total += value


def _p50_ms(samples_s: list[float]) -> float:
    return sorted(samples_s)[len(samples_s) // 2] * 1e3


def _compare_threads(rows: list[Row], num_threads: int, python_ms: float, repeats: int) -> None:
    """The fill of `rows` split over `num_threads` Python fill threads (one xgrammar call each, the
    design before 2026-12-06), then as StepBitmask does it: one call over xgrammar's own threads."""
    sys.setswitchinterval(grammar_module.FILL_SWITCH_INTERVAL_S)  # as StepBitmask sets it, for both
    host = torch.full(xgrammar.get_bitmask_shape(len(rows), VOCAB_SIZE), -1, dtype=torch.int32)
    pairs = [(index, row.grammar.matcher) for index, row in enumerate(rows)]
    per_thread = -(-len(pairs) // num_threads)
    parts = [pairs[first : first + per_thread] for first in range(0, len(pairs), per_thread)]
    local = threading.local()

    def fill_part(part: list[tuple[int, Any]]) -> None:
        batch = getattr(local, "batch", None) or xgrammar.BatchGrammarMatcher(1)
        local.batch = batch
        batch.batch_fill_next_token_bitmask([m for _, m in part], host, [r for r, _ in part])

    with ThreadPoolExecutor(num_threads) as filler:

        def start() -> list[Future[None]]:
            return [filler.submit(fill_part, part) for part in parts]

        def finish(futures: list[Future[None]]) -> None:
            for future in futures:
                future.result()

        _report(f"{num_threads} Python fill threads", start, finish, python_ms, repeats)

    saved = grammar_module.MAX_XGRAMMAR_THREADS, grammar_module.MIN_ROWS_PER_THREAD
    grammar_module.MAX_XGRAMMAR_THREADS, grammar_module.MIN_ROWS_PER_THREAD = num_threads, 1
    bitmask = StepBitmask(len(rows), VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    try:
        _report(
            f"StepBitmask, xgrammar max_threads={num_threads}",
            lambda: bitmask.start(rows),
            bitmask.finish,
            python_ms,
            repeats,
        )
    finally:
        bitmask.close()
        grammar_module.MAX_XGRAMMAR_THREADS, grammar_module.MIN_ROWS_PER_THREAD = saved


def _compare_accepts(rows: list[Row], python_ms: float, repeats: int) -> None:
    """finish()'s wait after `python_ms` of Python, with the grammars taking one token each: on the
    fill thread before the fill (GrammarTokens handed to start) or on this thread before start()."""
    from paged_llm.sequence import GrammarTokens

    scratch = torch.empty(xgrammar.get_bitmask_shape(1, VOCAB_SIZE), dtype=torch.int32)
    rng = random.Random(1)
    tokens = []
    for row in rows:
        row.grammar.matcher.fill_next_token_bitmask(scratch, 0)
        tokens.append(rng.choice([t for t in allowed_token_ids(scratch, VOCAB_SIZE) if t != EOS]))
    bitmask = StepBitmask(len(rows), VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    saved = sys.getswitchinterval()
    try:
        bitmask.finish(bitmask.start(rows))  # the fill thread up (it sets StepBitmask's interval)
        for interval_s in (0.0002, grammar_module.FILL_SWITCH_INTERVAL_S):
            sys.setswitchinterval(interval_s)
            for where in ("the fill thread", "this thread"):
                host_ms, waits = [], []
                for _ in range(repeats):
                    handed = GrammarTokens([row.grammar for row in rows], tokens, [False] * len(rows))
                    started = time.perf_counter()
                    if where == "this thread":
                        handed.take_all()
                        pending = bitmask.start(rows)
                    else:
                        pending = bitmask.start(rows, handed)
                    host_ms.append(time.perf_counter() - started)
                    _python_work(python_ms)
                    started = time.perf_counter()
                    bitmask.finish(pending)
                    waits.append(time.perf_counter() - started)
                    for row in rows:
                        row.grammar.matcher.rollback(1)
                print(
                    f"accept on {where}, switch interval {interval_s * 1e3:.2f} ms: start() "
                    f"{_p50_ms(host_ms):.3f} ms, then after {python_ms:g} ms of Python finish() waited "
                    f"p50 {_p50_ms(waits):.3f} ms"
                )
    finally:
        bitmask.close()
        sys.setswitchinterval(saved)


def _report(
    label: str, start: Callable[[], Any], finish: Callable[[Any], Any], python_ms: float, repeats: int
) -> None:
    wall, waits = _time_fills(start, finish, python_ms, repeats)
    print(
        f"{label}: fill wall p50 {_p50_ms(wall):.3f} ms; after {python_ms:g} ms of Python "
        f"finish() waited p50 {_p50_ms(waits):.3f} ms"
    )


def _time_fills(
    start: Callable[[], Any], finish: Callable[[Any], Any], python_ms: float, repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of each fill with this thread blocked at once (wall), and of each wait in finish()
    after `python_ms` of Python on this thread (waits)."""
    finish(start())  # threads up
    wall, waits = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        finish(start())
        wall.append(time.perf_counter() - started)
        pending = start()
        _python_work(python_ms)
        started = time.perf_counter()
        finish(pending)
        waits.append(time.perf_counter() - started)
    return wall, waits


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python-ms", type=float, default=2.0, help="Python work between start and finish")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", default="", help="comma-separated fill thread counts to compare")
    parser.add_argument("--accept", action="store_true", help="also time the grammars' accept")
    args = parser.parse_args()
    rows = _rows(args.rows, seed=0)
    if args.accept:
        _compare_accepts(rows, args.python_ms, args.repeats)
    for num_threads in [int(n) for n in args.threads.split(",") if n]:
        _compare_threads(rows, num_threads, args.python_ms, args.repeats)
    bitmask = StepBitmask(args.rows, VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    started = time.perf_counter()
    for _ in range(20):
        bitmask.fill(rows)
    print(f"fill on this thread: {(time.perf_counter() - started) / 20 * 1e3:.3f} ms for {args.rows} rows")
    try:
        for interval_s in (0.005, grammar_module.FILL_SWITCH_INTERVAL_S):
            bitmask.finish(bitmask.start(rows))  # the threads exist: start() lowers the interval once
            sys.setswitchinterval(interval_s)
            _, waits = _time_fills(lambda: bitmask.start(rows), bitmask.finish, args.python_ms, args.repeats)
            waits_ms = sorted(wait * 1e3 for wait in waits)
            p50, p90 = waits_ms[len(waits_ms) // 2], waits_ms[len(waits_ms) * 9 // 10]
            print(
                f"switch interval {interval_s * 1e3:.2f} ms: finish() waited p50 {p50:.3f} ms, "
                f"p90 {p90:.3f} ms after {args.python_ms:g} ms of Python"
            )
    finally:
        bitmask.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
