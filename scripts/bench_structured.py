"""Structured output benchmark: what a grammar costs, through the server and offline, one invocation.

  python scripts/bench_structured.py --launch REPO --json out.json [--plot out.png]

1. Compile: a typical 10-property JSON schema (strings, numbers, an enum, an array, a nested
   object, anyOf), cold (each schema new to the compiler; the first also starts the worker
   processes) and cached, through the engine core's GrammarCompiler on the checkpoint's tokenizer.
2. Served (gRPC streaming, one stream per request, like bench_serving.py), concurrency 64, 512 prompt
   tokens, 256 output tokens; three modes run in turn, twice (A B C A B C): every request
   unconstrained, every request held to the schema, half of them (alternate requests). Targets:
   constrained TPOT p50 <= 1.10x unconstrained; the half run's unconstrained requests within 3%.
   The measured requests run in a steady closed loop (steady_closed_loop): `concurrency` lead-in
   requests of staggered lengths (1/64 .. 64/64 of 256 tokens) go first, so that the measured ones
   start one after another, and as many trailing requests keep the batch full until the last one
   ends; neither counts. Without them a c64 run of 128 requests ran as two synchronised waves whose
   first half waited for the second half's prefill: two TPOT modes ~15% apart, and the p50 fell on
   either, by chance (Llama-3-8B shape, H100: constrained/free TPOT p50 1.102 at equal means).
   Batch 1 (concurrency 1), unconstrained and constrained in turn: <= 1.05x per token.
3. The compile cap: concurrency 64 unconstrained, once alone and once while a ~1 MB schema compiles
   until grammar_compile_timeout_s ends it: the other requests' ITL p99 moves by <= 5%.
4. Offline: the same c64 and batch-1 workloads on the in-process engine (the llm model's settings).

The schema's ten properties are strings of exactly 200 characters, so a constrained request always
runs to its 256 tokens (cut by max_tokens), as the unconstrained ones do with ignore_eos: both
modes produce the same number of tokens and TPOT compares like with like. (A `pattern` of 200
characters instead, `^[a-z]{200}$`, costs xgrammar ~3 ms per row and step to fill the mask on an
H200 host's CPU: its states fall outside xgrammar's precomputed masks.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import (
    ServerBefore,
    engine_figures,
    format_step_means,
    offline_engine,
    read_llm_parameters,
    run_served,
    server_engine_figures,
    step_means,
)
from tqdm import tqdm

from paged_llm.testing.bench_workload import (
    Job,
    cpu_model_name,
    format_summary,
    infer_inputs,
    random_workload,
    run_offline,
    summarize,
)

TARGETS = {"c64_tpot_ratio": 1.10, "half_tpot_ratio": 1.03, "b1_tpot_ratio": 1.05, "cold_compile_ms": 50.0,
           "cached_compile_ms": 1.0, "cap_itl_p99_ratio": 1.05}  # fmt: skip


def ten_property_schema() -> dict[str, Any]:
    """Ten required strings of exactly 200 characters: over 2,000 characters, more than 256 tokens of
    random-weight output as a rule (a token can hold up to 128 characters of Qwen's vocabulary, so a
    request may end before 256 tokens: the benchmark reports how many did)."""
    properties = {
        f"field_{index}": {"type": "string", "minLength": 200, "maxLength": 200} for index in range(10)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def typical_schema(tag: str = "") -> dict[str, Any]:
    """A ten-property schema of the kind applications send (the compile-time measurement's)."""
    properties = {
        f"{tag}id": {"type": "integer", "minimum": 0},
        f"{tag}name": {"type": "string", "maxLength": 64},
        f"{tag}email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        f"{tag}age": {"type": "integer", "minimum": 0, "maximum": 150},
        f"{tag}active": {"type": "boolean"},
        f"{tag}role": {"enum": ["admin", "user", "guest"]},
        f"{tag}score": {"type": "number", "minimum": 0, "maximum": 100},
        f"{tag}tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        f"{tag}address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        f"{tag}notes": {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "null"}]},
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def megabyte_schema(num_bytes: int = 1_000_000) -> dict[str, Any]:
    """A valid schema of about `num_bytes` bytes: objects of pattern-bound strings (minutes to compile)."""
    properties: dict[str, Any] = {}
    index = 0
    while len(json.dumps(properties)) < num_bytes - 2000:
        inner = {f"q{j}": {"type": "string", "pattern": "^[a-z]{1,8}$"} for j in range(20)}
        properties[f"p{index}"] = {"type": "object", "properties": inner}
        index += 1
    return {"type": "object", "properties": properties}


def measure_compiles(model_dir: Path, num_schemas: int) -> dict[str, Any]:
    """Cold and cached compile times of ten-property schemas through GrammarCompiler (the core's)."""
    from paged_llm.models.hf_config import load_model_spec
    from paged_llm.structured_output.compile import compile_constraint  # noqa: F401  (what workers run)
    from paged_llm.structured_output.compiler import GrammarCompiler
    from paged_llm.structured_output.tokenizer_info import build_tokenizer_info
    from paged_llm.structured_output_params import parse_structured_outputs

    spec = load_model_spec(model_dir)
    started = time.perf_counter()
    compiler = GrammarCompiler(
        lambda: build_tokenizer_info(model_dir, spec.vocab_size, spec.eos_token_ids),
        num_workers=2,
        timeout_s=30.0,
        cache_entries=512,
    )
    try:
        keys = []
        for index in range(num_schemas + 1):
            params = parse_structured_outputs({"json": typical_schema(f"s{index}_")}, None)
            assert params is not None
            keys.append((params.kind, params.spec, False))
        cold_ms = []
        for key in keys:
            sent = time.perf_counter()
            compiler.submit(key)
            while not compiler.wait_for_results(60.0):
                pass
            [result] = compiler.take_results()
            assert result.grammar is not None, result.error
            cold_ms.append(1e3 * (time.perf_counter() - sent))
        first_ms, cold_ms = cold_ms[0], cold_ms[1:]
        cached_ms = []
        for key in keys[1:] * 50:
            sent = time.perf_counter()
            assert compiler.cached(key) is not None
            cached_ms.append(1e3 * (time.perf_counter() - sent))
        return {
            "first_compile_ms": first_ms,  # tokenizer info + worker start + compile
            "setup_and_first_s": time.perf_counter() - started,
            "cold_ms": {"p50": statistics.median(cold_ms), "max": max(cold_ms), "all": cold_ms},
            "cached_ms": {"p50": statistics.median(cached_ms), "max": max(cached_ms)},
        }
    finally:
        compiler.close()


def steady_closed_loop(jobs: list[Job], concurrency: int) -> tuple[list[Job], set[int]]:
    """`jobs` (the first `concurrency` and the last `concurrency` not measured) with the lead-in's
    output lengths staggered over 1/concurrency .. 1 of the longest; returns the jobs and the
    indices of the measured ones (see the module's docstring)."""
    assert len(jobs) > 2 * concurrency, "a steady closed loop needs more jobs than its lead-in and tail"
    longest = max(job.num_output_tokens for job in jobs)
    staggered = [
        replace(job, num_output_tokens=max(1, round(longest * (position + 1) / concurrency)))
        if position < concurrency
        else job
        for position, job in enumerate(jobs)
    ]
    measured = {job.index for job in jobs[concurrency : len(jobs) - concurrency]}
    return staggered, measured


def _with(jobs: list[Job], mode: str, schema: dict[str, Any]) -> list[Job]:
    if mode == "free":
        return jobs
    return [
        replace(job, structured_outputs={"json": schema}) if mode == "json" or job.index % 2 else job
        for job in jobs
    ]


def _tpot_p50(records: list[Any], jobs: list[Job], constrained: bool | None) -> float:
    """TPOT p50 (ms) of the records whose job is (or is not, or either: None) constrained."""
    by_index = {job.index: job for job in jobs}
    chosen = [
        r
        for r in records
        if constrained is None or (by_index[r.index].structured_outputs is not None) == constrained
    ]
    return summarize(chosen)["tpot_ms"]["p50"]


def _send_megabyte_schema(
    url: str, model: str, schema: dict[str, Any], delay_s: float, outcome: dict
) -> None:
    """One request with the ~1 MB schema, `delay_s` into a run (its compile will hit the cap)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    time.sleep(delay_s)
    sampling = {"max_tokens": 16, "structured_outputs": {"json": schema}}
    arrays = [
        ("input_ids", np.asarray([1, 2, 3], dtype=np.int32), "INT32"),
        ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
    ]
    inputs = infer_inputs(grpcclient, arrays)
    client = grpcclient.InferenceServerClient(url)
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:  # tritonclient passes both by keyword
        outcome["error"] = None if error is None else str(error).splitlines()[0][:300]
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    sent = time.monotonic()
    client.start_stream(callback=callback)
    client.async_stream_infer(model, inputs, request_id="megabyte", enable_empty_final_response=True)
    done.wait(600)
    outcome["seconds"] = time.monotonic() - sent
    client.stop_stream()
    client.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--launch", type=Path, required=True, help="model repository: start tritonserver on it"
    )
    parser.add_argument("--model", default="llm")
    parser.add_argument("--rounds", type=int, default=2, help="served c64 rounds of (free, json, half)")
    parser.add_argument(
        "--num-prompts", type=int, default=128, help="measured requests per c64 run (and 2 x 64 unmeasured)"
    )
    parser.add_argument("--batch1-prompts", type=int, default=6)
    parser.add_argument(
        "--cap-prompts", type=int, default=384, help="requests per run of the compile-cap pair"
    )
    parser.add_argument("--num-compiles", type=int, default=20)
    parser.add_argument("--vocab-limit", type=int, default=32000)
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--no-offline", action="store_true", help="skip the offline engine runs")
    parser.add_argument("--server-log", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG: TPOT p50 per mode, served and offline")
    args = parser.parse_args()
    from paged_llm.models.builtin import resolve_model_dir
    from paged_llm.testing.server_process import start_server

    parameters = read_llm_parameters(args.launch)
    model_dir = resolve_model_dir(parameters.get("model", "tiny-qwen3"), args.launch / "llm")
    results: dict[str, Any] = {
        "model": str(model_dir),
        "parameters": parameters,
        "targets": TARGETS,
        "host_cpu": host_cpu(),  # the targets that need the host's work to hide depend on it
    }
    print(f"host CPU: {results['host_cpu']}", flush=True)
    schema = ten_property_schema()
    results["compile"] = measure_compiles(model_dir, args.num_compiles)
    print(
        f"compile: {json.dumps({k: v for k, v in results['compile'].items()}, default=str)[:400]}", flush=True
    )

    seed = iter(range(10_000))

    def jobs(num: int, input_len: str, output_len: str) -> list[Job]:
        return random_workload(num, input_len, output_len, args.vocab_limit, 7919 * next(seed))

    log_path = args.server_log or Path(tempfile.mkdtemp(prefix="bench_structured.")) / "server.log"
    server = start_server(args.launch.resolve(), log_path, timeout_s=1800.0)
    url = server.grpc_url
    served: dict[str, list[dict[str, Any]]] = {}
    last_steps: dict[str, dict[str, float | None]] = {}

    def serve(
        label: str, run_jobs: list[Job], concurrency: int, measured: set[int] | None = None
    ) -> list[Any]:
        """The records of the measured jobs (all when `measured` is None); the engine core's own step
        periods over the whole run go to `last_steps`."""
        before = ServerBefore(server)  # read once the client processes' warm-up requests are done
        records, _ = run_served(
            url, args.model, run_jobs, concurrency, args.client_processes, before_start=before
        )
        steps_before = before["steps"]
        last_steps.clear()
        last_steps.update(step_means(steps_before, server_engine_figures(server)))
        every = summarize(records)
        assert every["num_errors"] == 0, (label, every["errors"])
        if measured is not None:
            records = [r for r in records if r.index in measured]
        summary = summarize(records)
        print(format_summary(f"served {label}", summary), flush=True)
        print(f"   engine steps: {format_step_means(last_steps)}", flush=True)
        by_index = {job.index: job for job in run_jobs}
        short = [r for r in records if r.num_output_tokens < by_index[r.index].num_output_tokens]
        if short:  # a grammar that ended: fewer tokens than max_tokens, a TPOT over fewer steps
            print(f"   {len(short)} constrained requests ended early (grammar complete), "
                  f"{min(r.num_output_tokens for r in short)} tokens the fewest", flush=True)  # fmt: skip
        return records

    try:
        warm = jobs(16, "16", "8")
        serve("warm-up", _with(warm, "json", schema), 16)  # compiles the schema: later runs hit the cache
        plan = [
            (mode, round_index) for round_index in range(args.rounds) for mode in ("free", "json", "half")
        ]
        for mode, round_index in tqdm(plan, desc="c64", unit="run"):
            run_jobs, measured = steady_closed_loop(jobs(args.num_prompts + 2 * 64, "512", "256"), 64)
            run_jobs = _with(run_jobs, mode, schema)
            records = serve(f"c64 {mode} #{round_index}", run_jobs, 64, measured)
            entry = {
                "round": round_index,
                "summary": summarize(records),
                "tpot_p50_ms": _tpot_p50(records, run_jobs, None),
                "engine_steps": dict(last_steps),
            }
            if mode == "half":
                entry["tpot_p50_free_half_ms"] = _tpot_p50(records, run_jobs, False)
                entry["tpot_p50_json_half_ms"] = _tpot_p50(records, run_jobs, True)
            served.setdefault(f"c64_{mode}", []).append(entry)
        for round_index in range(args.rounds):
            for mode in ("free", "json"):
                run_jobs = _with(jobs(args.batch1_prompts, "128", "256"), mode, schema)
                records = serve(f"b1 {mode} #{round_index}", run_jobs, 1)
                entry = {"round": round_index, "summary": summarize(records)}
                entry["tpot_p50_ms"] = _tpot_p50(records, run_jobs, None)
                entry["engine_steps"] = dict(last_steps)
                served.setdefault(f"b1_{mode}", []).append(entry)
        big = megabyte_schema()
        results["megabyte_schema_bytes"] = len(json.dumps(big))
        for label in ("alone", "with_megabyte_compile"):
            run_jobs = jobs(args.cap_prompts, "512", "256")
            sent: dict[str, Any] = {}
            sender = None
            if label != "alone":
                sender = threading.Thread(
                    target=_send_megabyte_schema, args=(url, args.model, big, 1.0, sent)
                )
                sender.start()
            records = serve(f"cap {label}", run_jobs, 64)
            if sender is not None:
                sender.join(600)
                results["megabyte_request"] = sent
                print(f"   the ~1 MB schema's request: {sent}", flush=True)
            served.setdefault("cap", []).append(
                {"label": label, "summary": summarize(records), "engine_steps": dict(last_steps)}
            )
    finally:
        server.stop()
    results["served"] = served

    if not args.no_offline:
        engine = offline_engine(args.launch, None, "inprocess")
        offline: dict[str, Any] = {}
        try:
            run_offline(engine, _with(jobs(16, "16", "8"), "json", schema), 16)
            workloads = {"c64": (args.num_prompts, "512", 64), "b1": (args.batch1_prompts, "128", 1)}
            for mode in ("free", "json"):
                for name, (num, input_len, concurrency) in workloads.items():
                    run_jobs, measured = jobs(num, input_len, "256"), None
                    if concurrency > 1:
                        run_jobs, measured = steady_closed_loop(
                            jobs(num + 2 * concurrency, input_len, "256"), concurrency
                        )
                    run_jobs = _with(run_jobs, mode, schema)
                    steps_before = engine_figures(engine)
                    records = run_offline(engine, run_jobs, concurrency)
                    steps = step_means(steps_before, engine_figures(engine))
                    if measured is not None:
                        records = [r for r in records if r.index in measured]
                    summary = summarize(records)
                    offline[f"{name}_{mode}"] = {
                        "summary": summary,
                        "tpot_p50_ms": _tpot_p50(records, run_jobs, None),
                        "engine_steps": steps,
                    }
                    print(format_summary(f"offline {name} {mode}", summary), flush=True)
                    print(f"   engine steps: {format_step_means(steps)}", flush=True)
        finally:
            engine.shutdown()
        results["offline"] = offline

    results["verdict"] = verdict(results)
    for name, (value, target, ok) in results["verdict"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name}: {value:.3f} (target {target})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.plot:
        plot(results, args.plot)
    return 0


def host_cpu() -> str:
    """The host CPU's model name and the cores this process may use."""
    return f"{cpu_model_name() or 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores"


def verdict(results: dict[str, Any]) -> dict[str, tuple[float, float, bool]]:
    served = results["served"]

    def mean(key: str, field: str = "tpot_p50_ms") -> float:
        return statistics.mean(entry[field] for entry in served[key])

    free = mean("c64_free")
    values = {
        "c64_tpot_ratio": mean("c64_json") / free,
        "half_tpot_ratio": mean("c64_half", "tpot_p50_free_half_ms") / free,
        "b1_tpot_ratio": mean("b1_json") / mean("b1_free"),
        "cold_compile_ms": results["compile"]["cold_ms"]["p50"],
        "cached_compile_ms": results["compile"]["cached_ms"]["max"],
    }
    alone, loaded = (entry["summary"]["itl_ms"]["p99"] for entry in served["cap"])
    values["cap_itl_p99_ratio"] = loaded / alone
    return {name: (value, TARGETS[name], value <= TARGETS[name]) for name, value in values.items()}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for key in ("c64_free", "c64_json", "c64_half", "b1_free", "b1_json"):
        labels.append(f"served {key}")
        values.append(statistics.mean(entry["tpot_p50_ms"] for entry in results["served"][key]))
        if key in results.get("offline", {}):
            labels.append(f"offline {key}")
            values.append(results["offline"][key]["tpot_p50_ms"])
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.barh(labels, values)
    axis.set_xlabel("TPOT p50 (ms)")
    axis.set_title(f"structured output: {Path(results['model']).name}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
