"""Where an offline run's time goes, step by step: the host's phases and the GPU's busy and idle
time for every step of one run of bench_offline.py's workload, then torch.profiler windows over
chosen steps for the kernels.

  python scripts/profile_offline.py --model /tmp/qwen3-0.6b --num-requests 256 --input-len 100:1024 \\
      --output-len 100:1024 --max-num-batched-tokens 16384 --max-model-len 2048 \\
      --trace-steps 2:5,300:306,900:906 --out /tmp/profile

Run 1 (no profiler) records per step, with two CUDA events around each launch on the step's stream:
  gpu_ms   the step's span on the device (first to last of its work, host stalls inside included)
  idle_ms  the device's idle time before the step: from the previous step's end to this one's start,
           i.e. the time the host was late with this launch
  host     schedule / inputs (the step's input tensors built) / launch (the rest: graph replays or eager
           launches, sampling) / wait (the host blocked on the
           step's tokens) / update (the scheduler applies the tokens) / publish (the core's outputs) /
           absorb (output processing: detokenizing, RequestOutputs) / other (the rest of the loop)
Run 2 (prefix cache reset first, same requests) profiles the --trace-steps windows with torch.profiler:
kernel time per step by category and the top kernels; the chrome traces go to --out.
Writes steps.json (run 1's records), summary.json, profile.txt (what is printed), steps.png.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.gc_pauses import process_gc_pauses
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.models.hf_config import load_model_spec
from paged_llm.runner.step_types import LaunchedStep
from paged_llm.sampling_params import SamplingParams
from paged_llm.tokenizer.hf_tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import copy_bandwidth_gb_per_s, kv_bytes_per_token, synchronize, weight_bytes
from bench_offline import add_engine_arguments, batch_bucket, engine_config, make_workload

CUDA = torch.cuda.is_available()  # on a CPU (a smoke run) the host phases only
DEVICE = torch.device("cuda" if CUDA else "cpu")
PHASES = ("schedule", "inputs", "launch", "wait", "update", "publish", "absorb", "other")
# Kernel name -> category, first match wins (Triton kernels keep their Python names).
KERNEL_CATEGORIES = (
    ("attention", re.compile(r"attn|attention|flash|paged|decode_kernel|prefill_kernel", re.I)),
    ("gemv", re.compile(r"gemv", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cutlass|sm90|sm80|xmma|nvjet|cublas|wgmma", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("rope", re.compile(r"rope|rotary", re.I)),
    ("kv-write", re.compile(r"cache|store_kv|write_kv|reshape_and", re.I)),
    ("sampling", re.compile(r"sampl|argmax|softmax|topk|top_k|sort|gumbel|exponential|max_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|fill|index|gather|scatter|cat", re.I)),
    ("activation", re.compile(r"silu|gelu|mul|act", re.I)),
)


@dataclass
class StepRecord:
    index: int
    num_rows: int
    num_tokens: int
    prefill: bool
    num_context_tokens: int = 0  # KV tokens the step's attention reads (its rows' lengths after it)
    running_after: int = 0
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    gpu_ms: float = 0.0
    idle_ms: float = 0.0
    events: Any = None  # (start, end) CUDA events; dropped once read


class StepRecorder:
    """Times the engine's phases per step by wrapping the objects' methods (instance attributes;
    LaunchedStep.result on the class, restored by close())."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        core = engine.core
        self.records: list[StepRecord] = []
        self._by_output: dict[int, StepRecord] = {}
        self._by_launched: dict[int, StepRecord] = {}
        self._finishing: StepRecord | None = None
        self._schedule_s = 0.0
        self._inputs_s = 0.0
        self.on_launch: Callable[[int], None] | None = None
        scheduler, runner = core.scheduler, core.runner
        scheduler.schedule = self._timed_schedule(scheduler.schedule)
        runner.launch = self._timed_launch(runner.launch)
        runner.buffers.prepare = self._timed_inputs(runner.buffers.prepare)
        scheduler.update_from_output = self._timed_update(scheduler.update_from_output)
        core._publish_updates = self._timed_phase(core._publish_updates, "publish")
        engine._absorb = self._timed_phase(engine._absorb, "absorb")
        self._original_result = LaunchedStep.result
        recorder = self

        def result(step: LaunchedStep) -> Any:
            start = time.perf_counter()
            try:
                return recorder._original_result(step)
            finally:
                record = recorder._by_launched.pop(id(step), None)
                if record is not None:
                    record.host_s["wait"] += time.perf_counter() - start

        LaunchedStep.result = result  # type: ignore[method-assign]

    def close(self) -> None:
        LaunchedStep.result = self._original_result  # type: ignore[method-assign]

    def _timed_schedule(self, schedule: Callable[[], Any]) -> Callable[[], Any]:
        def wrapper() -> Any:
            start = time.perf_counter()
            output = schedule()
            self._schedule_s = time.perf_counter() - start
            return output

        return wrapper

    def _timed_launch(self, launch: Callable[..., LaunchedStep]) -> Callable[..., LaunchedStep]:
        def wrapper(scheduler_output: Any, previous: Any = None) -> LaunchedStep:
            scheduled = scheduler_output.scheduled
            record = StepRecord(
                len(self.records),
                len(scheduled),
                scheduler_output.num_batched_tokens,
                scheduler_output.num_batched_tokens > len(scheduled),
                sum(s.num_computed_tokens + s.num_new_tokens for s in scheduled),
            )
            record.host_s["schedule"] = self._schedule_s
            if self.on_launch is not None:
                self.on_launch(record.index)
            start = time.perf_counter()
            if CUDA:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                launched = launch(scheduler_output, previous)
                end.record()
                record.events = (begin, end)
            else:
                launched = launch(scheduler_output, previous)
            # launch: the rest of the launch (forward and sampling enqueued, graphs replayed)
            record.host_s["inputs"] = self._inputs_s
            record.host_s["launch"] = time.perf_counter() - start - self._inputs_s
            self.records.append(record)
            self._by_output[id(scheduler_output)] = record
            self._by_launched[id(launched)] = record
            return launched

        return wrapper

    def _timed_inputs(self, prepare: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return prepare(*args, **kwargs)
            finally:
                self._inputs_s = time.perf_counter() - start

        return wrapper

    def _timed_update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = update(scheduler_output, *args, **kwargs)
            record = self._by_output.pop(id(scheduler_output), None)
            if record is not None:
                record.host_s["update"] += time.perf_counter() - start
                record.running_after = len(self.engine.core.scheduler.running)
                self._finishing = record
            return result

        return wrapper

    def _timed_phase(self, method: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if self._finishing is not None:
                    self._finishing.host_s[phase] += time.perf_counter() - start

        return wrapper

    def loop_iteration(self, seconds: float) -> None:
        """One engine.step() took `seconds`: what no phase accounts for goes to the step it finished."""
        record, self._finishing = self._finishing, None
        if record is not None:
            record.host_s["other"] = max(0.0, seconds - sum(record.host_s.values()) + record.host_s["other"])

    def read_device_times(self) -> None:
        if not CUDA:
            return
        torch.cuda.synchronize()
        previous_end = None
        for record in self.records:
            begin, end = record.events
            record.gpu_ms = begin.elapsed_time(end)
            record.idle_ms = previous_end.elapsed_time(begin) if previous_end is not None else 0.0
            previous_end, record.events = end, None


def submit(engine: LLMEngine, workload: list[tuple[list[int], int]], prefix: str) -> int:
    for index, (prompt, num_output) in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=num_output, ignore_eos=True)
        engine.add_request(f"{prefix}-{index}", prompt, params)
    return sum(n for _, n in workload)


def run_recorded(engine: LLMEngine, workload: list[tuple[list[int], int]], show_progress: bool) -> dict:
    recorder = StepRecorder(engine)
    total = submit(engine, workload, "profile")
    gc_before = process_gc_pauses()
    synchronize(DEVICE)
    start = time.perf_counter()
    produced = 0
    try:
        with tqdm(total=total, desc="recorded run", unit="tok", disable=not show_progress) as bar:
            while engine.has_unfinished_requests():
                begin = time.perf_counter()
                outputs = engine.step()
                recorder.loop_iteration(time.perf_counter() - begin)
                new = sum(len(s.token_ids) for output in outputs for s in output.sequences)
                produced += new
                bar.update(new)
        synchronize(DEVICE)
        elapsed_s = time.perf_counter() - start
        gc_pauses = process_gc_pauses().since(gc_before)
        recorder.read_device_times()
    finally:
        recorder.close()
    assert produced == total, f"engine produced {produced} tokens, expected {total}"
    return {
        "elapsed_s": elapsed_s,
        "num_output_tokens": produced,
        "records": recorder.records,
        "gc_pauses": asdict(gc_pauses),
    }


def run_traced(
    engine: LLMEngine, workload: list[tuple[list[int], int]], windows: list[tuple[int, int]], out: Path
) -> list[dict]:
    """Run 2: torch.profiler over each window [first, last) of launched steps."""
    from torch.profiler import ProfilerActivity, profile

    recorder = StepRecorder(engine)
    active: dict[str, Any] = {"profiler": None, "window": None}
    results: list[dict] = []

    def on_launch(index: int) -> None:
        window = active["window"]
        if window is not None and index >= window[1]:
            _finish_window(active, results, out)
        if active["profiler"] is None:
            for first, last in windows:
                if first <= index < last:
                    synchronize(DEVICE)
                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
                    active["profiler"] = profile(activities=activities)
                    active["profiler"].start()
                    active["window"] = (first, last)
                    break

    recorder.on_launch = on_launch
    total = submit(engine, workload, "traced")
    produced = 0
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            produced += sum(len(s.token_ids) for output in outputs for s in output.sequences)
        if active["profiler"] is not None:
            _finish_window(active, results, out)
    finally:
        recorder.close()
    assert produced == total
    for result in results:
        first, last = result["window"]
        rows = recorder.records[first:last]
        result["num_rows"] = [r.num_rows for r in rows]
        result["num_tokens"] = [r.num_tokens for r in rows]
        result["num_context_tokens"] = [r.num_context_tokens for r in rows]
    return results


def _finish_window(active: dict[str, Any], results: list[dict], out: Path) -> None:
    synchronize(DEVICE)
    profiler, (first, last) = active["profiler"], active["window"]
    profiler.stop()
    active["profiler"] = active["window"] = None
    trace = out / f"trace_steps_{first}_{last}.json"
    profiler.export_chrome_trace(str(trace))
    results.append({"window": [first, last], **summarize_trace(trace, last - first)})
    with trace.open("rb") as source, gzip.open(f"{trace}.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    trace.unlink()


def summarize_trace(trace: Path, num_steps: int) -> dict:
    """Kernel time per step by category and kernel; the device's busy share of the window."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not kernels:
        return {"busy_share": None, "categories_ms": {}, "top_kernels_ms": {}, "window_ms": 0.0}
    intervals = sorted((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0.0))) for k in kernels)
    busy_us, current_start, current_end = 0.0, intervals[0][0], intervals[0][1]
    for begin, end in intervals[1:]:
        if begin > current_end:
            busy_us += current_end - current_start
            current_start, current_end = begin, end
        else:
            current_end = max(current_end, end)
    busy_us += current_end - current_start
    window_us = intervals[-1][1] - intervals[0][0]
    by_kernel: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        by_kernel[kernel["name"]] += float(kernel.get("dur", 0.0))
    by_category: dict[str, float] = defaultdict(float)
    for name, micros in by_kernel.items():
        by_category[kernel_category(name)] += micros
    per_step = max(1, num_steps)
    top = sorted(by_kernel.items(), key=lambda item: -item[1])[:25]
    return {
        "window_ms": window_us / 1e3,
        "busy_share": busy_us / window_us if window_us else None,
        "categories_ms": {k: v / 1e3 / per_step for k, v in sorted(by_category.items(), key=lambda i: -i[1])},
        "top_kernels_ms": {k: v / 1e3 / per_step for k, v in top},
    }


def kernel_category(name: str) -> str:
    for category, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def bandwidth_bound(records: list[StepRecord], engine: LLMEngine, copy_bytes_per_s: float) -> dict:
    """What the card allows: every step reads the weights once (bench_decode.py's count) and its
    rows' KV, at the copy rate (read + write bytes of a large copy, as bench_decode.py measures it).
    Prompt steps are counted the same way, so the bound is a little optimistic for them."""
    kv_bytes_token = kv_bytes_per_token(engine)
    step_weight_bytes = weight_bytes(engine)
    kv_bytes = kv_bytes_token * sum(r.num_context_tokens for r in records)
    total_bytes = kv_bytes + step_weight_bytes * len(records)
    return {
        "copy_bytes_per_s": copy_bytes_per_s,
        "kv_bytes_per_token": kv_bytes_token,
        "weight_bytes": step_weight_bytes,
        "kv_bytes_read": kv_bytes,
        "weight_bytes_read": step_weight_bytes * len(records),
        "bound_s": total_bytes / copy_bytes_per_s if copy_bytes_per_s else None,
    }


def summarize_run(run: dict) -> dict:
    records: list[StepRecord] = run["records"]
    elapsed_s = run["elapsed_s"]
    gpu_s = sum(r.gpu_ms for r in records) / 1e3
    idle_s = sum(r.idle_ms for r in records) / 1e3
    phases_s = {p: sum(r.host_s[p] for r in records) for p in PHASES}
    groups: dict[str, list[StepRecord]] = defaultdict(list)
    for record in records:
        groups[("prefill " if record.prefill else "decode ") + batch_bucket(record.num_rows)].append(record)
    table = {}
    bound = run.get("bound") or {}
    rate = bound.get("copy_bytes_per_s") or 0.0
    for name in sorted(groups, key=_group_order):
        group = groups[name]
        count = len(group)
        table[name] = {
            "steps": count,
            "mean_rows": sum(r.num_rows for r in group) / count,
            "mean_tokens": sum(r.num_tokens for r in group) / count,
            "mean_context_tokens": sum(r.num_context_tokens for r in group) / count,
            # the step's reads at the copy rate: what the device needs at the least
            "bound_ms": 1e3
            * sum(bound["kv_bytes_per_token"] * r.num_context_tokens + bound["weight_bytes"] for r in group)
            / count
            / rate
            if rate
            else 0.0,
            "gpu_ms": sum(r.gpu_ms for r in group) / count,
            "idle_ms": sum(r.idle_ms for r in group) / count,
            "host_ms": {p: 1e3 * sum(r.host_s[p] for r in group) / count for p in PHASES},
            "seconds": (sum(r.gpu_ms for r in group) + sum(r.idle_ms for r in group)) / 1e3,
        }
    return {
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": run["num_output_tokens"] / elapsed_s,
        "num_steps": len(records),
        "gpu_busy_s": gpu_s,
        "gpu_idle_between_steps_s": idle_s,
        "host_phases_s": phases_s,
        "groups": table,
        "bound": run.get("bound"),
        "gc_pauses": run.get("gc_pauses"),
    }


def _group_order(name: str) -> tuple[str, int]:
    """Prefill/decode, then batch size ("decode <=64" before "decode <=128", "any" last)."""
    kind, bucket = name.split()
    return kind, int(bucket.removeprefix("<=")) if bucket.startswith("<=") else 1 << 30


def format_summary(summary: dict) -> str:
    bound = summary.get("bound") or {}
    lines = [
        f"run: {summary['elapsed_s']:.2f} s, {summary['output_tokens_per_s']:.0f} output tok/s, "
        f"{summary['num_steps']} steps",
    ]
    if bound.get("bound_s"):
        lines.append(
            f"bound: KV reads {bound['kv_bytes_read'] / 1e12:.2f} TB + weights "
            f"{bound['weight_bytes_read'] / 1e12:.2f} TB at {bound['copy_bytes_per_s'] / 1e12:.2f} TB/s "
            f"(copy) = {bound['bound_s']:.2f} s, i.e. "
            f"{summary['elapsed_s'] and bound['bound_s'] / summary['elapsed_s']:.0%} reached"
        )
    lines += [
        f"device: steps' spans {summary['gpu_busy_s']:.2f} s, idle between steps "
        f"{summary['gpu_idle_between_steps_s']:.2f} s",
        "garbage collection in this process: {num_collections} collections, {pause_s_total:.3f} s, "
        "longest {longest_pause_s:.4f} s".format(**summary["gc_pauses"]),
        "host, whole run (s): " + ", ".join(f"{p} {s:.2f}" for p, s in summary["host_phases_s"].items()),
        f"{'group':<16}{'steps':>6}{'rows':>6}{'tokens':>8}{'context':>9}{'bound ms':>9}{'gpu ms':>8}"
        f"{'idle ms':>8}{'secs':>7}  " + " ".join(f"{p[:7]:>7}" for p in PHASES),
    ]
    for name, g in summary["groups"].items():
        lines.append(
            f"{name:<16}{g['steps']:>6}{g['mean_rows']:>6.0f}{g['mean_tokens']:>8.0f}"
            f"{g['mean_context_tokens']:>9.0f}{g['bound_ms']:>9.3f}{g['gpu_ms']:>8.3f}"
            f"{g['idle_ms']:>8.3f}{g['seconds']:>7.2f}  "
            + " ".join(f"{g['host_ms'][p]:>7.3f}" for p in PHASES)
        )
    return "\n".join(lines)


def format_window(window: dict) -> str:
    first, last = window["window"]
    rows = window.get("num_rows", [])
    tokens = window.get("num_tokens", [])
    busy = window["busy_share"]
    lines = [
        f"steps {first}..{last - 1}: rows {min(rows, default=0)}-{max(rows, default=0)}, tokens "
        f"{min(tokens, default=0)}-{max(tokens, default=0)}, context tokens "
        f"{sum(window.get('num_context_tokens', [])) // max(1, len(rows))} a step; "
        f"window {window['window_ms']:.2f} ms, device busy " + (f"{busy:.1%}" if busy is not None else "n/a"),
        "  per step, by category (ms): "
        + ", ".join(f"{k} {v:.3f}" for k, v in window["categories_ms"].items()),
        "  top kernels, per step (ms):",
    ]
    lines += [f"    {v:8.3f}  {k[:110]}" for k, v in window["top_kernels_ms"].items()]
    return "\n".join(lines)


def plot_steps(records: list[StepRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = [r.index for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    top.plot(index, [r.gpu_ms for r in records], lw=0.7, label="device span (ms)")
    top.plot(
        index,
        [1e3 * sum(r.host_s[p] for p in PHASES if p != "wait") for r in records],
        lw=0.7,
        label="host work, wait excluded (ms)",
    )
    top.plot(index, [r.idle_ms for r in records], lw=0.7, label="device idle before step (ms)")
    top.set_ylabel("ms")
    top.set_yscale("log")
    top.legend()
    bottom.plot(index, [r.num_rows for r in records], lw=0.7, label="rows")
    bottom.plot(index, [r.num_tokens for r in records], lw=0.7, label="tokens")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_windows(text: str) -> list[tuple[int, int]]:
    windows = []
    for part in filter(None, text.split(",")):
        first, last = (int(x) for x in part.split(":"))
        windows.append((first, last))
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--trace-steps", default="", help="FIRST:LAST windows of launched steps, e.g. 2:5,300:306"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(args.model)
    spec = load_model_spec(model_dir)
    workload = make_workload(args, min(spec.vocab_size, len(load_tokenizer(model_dir))))
    engine = LLMEngine(engine_config(args), show_progress=not args.no_progress)
    for index, (prompt, _) in enumerate(workload[:8]):  # warm-up, as bench_offline
        engine.add_request(
            f"warmup-{index}", prompt[:32], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.reset_prefix_cache()
    card = torch.cuda.get_device_name() if CUDA else "cpu"
    report: list[str] = [f"{card}, torch {torch.__version__}", " ".join(sys.argv)]
    copy_bytes_per_s = copy_bandwidth_gb_per_s(DEVICE) * 1e9
    run = run_recorded(engine, workload, not args.no_progress)
    run["bound"] = bandwidth_bound(run["records"], engine, copy_bytes_per_s)
    summary = summarize_run(run)
    report.append(format_summary(summary))
    print(report[-1], flush=True)
    (args.out / "steps.json").write_text(json.dumps([asdict(r) | {"events": None} for r in run["records"]]))
    plot_steps(run["records"], args.out / "steps.png")
    windows = parse_windows(args.trace_steps)
    traced: list[dict] = []
    if windows:
        engine.core.reset_prefix_cache()
        traced = run_traced(engine, workload, windows, args.out)
        for window in traced:
            report.append(format_window(window))
            print(report[-1], flush=True)
    (args.out / "summary.json").write_text(
        json.dumps({"argv": sys.argv, "run": summary, "windows": traced}, indent=1)
    )
    (args.out / "profile.txt").write_text("\n".join(report) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
