"""scripts/bench_serving.py's plan: every run of an invocation gets prompts of its own, so that no
run is served from the prefix cache that an earlier run of the same invocation filled."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from paged_llm.paths import repo_root


def _bench_serving():
    spec = importlib.util.spec_from_file_location(
        "bench_serving", repo_root() / "scripts" / "bench_serving.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_runs_never_repeat_prompts_and_the_first_run_keeps_the_seed():
    bench = _bench_serving()
    args = argparse.Namespace(
        scenario=["sweep:8:128:16:c=1,2,4", "batch1:8:128:32:c=1", "burst:8:100-1024:16:r=inf"],
        vocab_limit=1000,
        seed=0,
    )
    runs = bench.plan_runs(args)
    assert [r.label for r in runs] == [
        "sweep, concurrency 1",
        "sweep, concurrency 2",
        "sweep, concurrency 4",
        "batch1, concurrency 1",
        "burst, request rate inf",
    ]
    first_blocks = [tuple(job.prompt_token_ids[:16]) for run in runs for job in run.jobs]
    assert len(set(first_blocks)) == len(first_blocks), "two requests share their first 16-token block"
    assert runs[0].jobs == bench.random_workload(8, "128", "16", 1000, 0)
    assert all(len(job.prompt_token_ids) == 128 for run in runs[:4] for job in run.jobs)
