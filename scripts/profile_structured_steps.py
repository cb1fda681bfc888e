"""Where a constrained step's time goes: host phases and device time per engine step, offline.

Runs the offline engine (in-process core) on a closed loop of requests, unconstrained and then all
held to bench_structured's 10-property schema, and reports per step: the host time of each phase
(launch = schedule + inputs + enqueue; wait = the host blocked on the device's tokens; update =
the scheduler taking the tokens, grammars included (accept: their one xgrammar call); fill = the
grammar bitmask, on a background thread for steps launched ahead; sample_deferred = the deferred
sampling, its wait for that fill (fill_wait) included; absorb = output processing) and the device
time of the forward and of the sampling (CUDA events; CPU runs report host phases only). A step
whose device time is far below its wall time is waiting for the host.

    python scripts/profile_structured_steps.py --launch REPO --concurrency 64 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import offline_engine
from bench_structured import _with, ten_property_schema

from paged_llm.testing.bench_workload import random_workload, run_offline


class PhaseTimer:
    """Host seconds per phase, and device events around the forward and the sampling."""

    def __init__(self, cuda: bool) -> None:
        self.host_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.cuda = cuda
        self.events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, phase: str, device: bool = False) -> None:
        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            events = None
            if device and self.cuda:
                import torch

                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            try:
                return original(*args, **kwargs)
            finally:
                if events is not None:
                    events[1].record()
                    self.events[phase].append(events)
                self.host_s[phase] += time.perf_counter() - start
                self.calls[phase] += 1

        setattr(owner, name, staticmethod(timed) if static else timed)
        self._restore.append(lambda: setattr(owner, name, staticmethod(original) if static else original))

    def reset(self) -> None:
        self.host_s.clear()
        self.calls.clear()
        self.events.clear()

    def report(self, num_steps: int, wall_s: float) -> dict[str, Any]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        per_step = {phase: 1e3 * seconds / max(num_steps, 1) for phase, seconds in self.host_s.items()}
        device = {
            phase: sum(b.elapsed_time(e) for b, e in pairs) / max(num_steps, 1)
            for phase, pairs in self.events.items()
        }
        return {
            "num_steps": num_steps,
            "step_wall_ms": 1e3 * wall_s / max(num_steps, 1),
            "host_ms_per_step": dict(sorted(per_step.items())),
            "calls": dict(sorted(self.calls.items())),
            "device_ms_per_step": dict(sorted(device.items())),
        }

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        try:
            yield
        finally:
            for restore in reversed(self._restore):
                restore()


def install(timer: PhaseTimer, engine: Any) -> None:
    from paged_llm.engine.engine_core.core import EngineCore
    from paged_llm.runner.model_runner import ModelRunner
    from paged_llm.runner.step_types import LaunchedStep
    from paged_llm.sampling.sampler import SamplingMetadata
    from paged_llm.structured_output.grammar import SequenceGrammar, StepBitmask

    timer.wrap(EngineCore, "launch_step", "launch")
    timer.wrap(LaunchedStep, "result", "wait")
    timer.wrap(type(engine.client.core.scheduler), "update_from_output", "update")
    timer.wrap(SequenceGrammar, "accept_tokens", "accept")  # on the fill thread when deferred
    timer.wrap(ModelRunner, "sample_deferred", "sample_deferred")
    timer.wrap(StepBitmask, "_take_and_fill", "fill")  # accept + fill; on the fill thread when started ahead
    timer.wrap(StepBitmask, "finish", "fill_wait")
    timer.wrap(SamplingMetadata, "build", "metadata")
    timer.wrap(type(engine), "_absorb", "absorb")
    timer.wrap(ModelRunner, "forward_step", "forward", device=True)
    timer.wrap(ModelRunner, "_sample", "sample", device=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launch", type=Path, required=True, help="model repository (its llm parameters)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="512")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--vocab-limit", type=int, default=32000)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--modes", default="free,json", help="comma-separated: free, json, half (alternate rows)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    modes = args.modes.split(",")

    engine = offline_engine(args.launch, None, "inprocess")
    cuda = engine.client.core.runner.device.is_accelerator
    timer = PhaseTimer(cuda)
    schema = ten_property_schema()
    results: dict[str, Any] = {"concurrency": args.concurrency}
    try:
        run_offline(engine, _with(random_workload(16, "16", "8", args.vocab_limit, 1), "json", schema), 16)
        install(timer, engine)
        with timer.installed():
            for index, mode in enumerate(modes * args.rounds):
                jobs = random_workload(
                    args.num_prompts, args.input_len, args.output_len, args.vocab_limit, 100 + index
                )
                core = engine.client.core
                steps_before = core.num_steps
                timer.reset()
                start = time.perf_counter()
                run_offline(engine, _with(jobs, mode, schema), args.concurrency)
                report = timer.report(core.num_steps - steps_before, time.perf_counter() - start)
                results[f"{mode}_{index // len(modes)}"] = report
                print(mode, json.dumps(report), flush=True)
    finally:
        engine.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
