"""Serving benchmark: requests through a running tritonserver over gRPC streaming, one stream per
request, like vLLM's benchmark_serving.py (metrics defined in paged_llm/testing/bench_workload.py).

  # against a server you started (make serve, or the GPU host's bring-up script)
  .venv/bin/python scripts/bench_serving.py --url 127.0.0.1:8001 --num-prompts 64 --concurrency 1,4,16
  # start the server on a model repository, benchmark it, stop it, then run the offline engine on
  # the same workload with the same engine settings (the llm model's config.pbtxt) and compare
  python scripts/bench_serving.py --launch REPO --compare-offline --num-prompts 256 \\
      --input-len 100:1024 --output-len 100:1024 --request-rate inf

Through the OpenAI server: `--endpoint openai` (or `both`: gRPC and OpenAI in turn on the same
server, printing what the OpenAI path adds to TTFT p50 and ITL p50); with --launch the OpenAI server
is started too, else give --openai-url.

Load: `--concurrency C[,C2,...]` keeps C requests in flight (each level is one run, the sweep is
plotted), or `--request-rate R` sends Poisson arrivals at R requests/s (`inf`: all at once).
Several workloads in one invocation (one server start, one offline engine):
  --scenario NAME:NUM_PROMPTS:INPUT_LEN:OUTPUT_LEN:LOAD[:lora=A+B]   LOAD = c=1,2,4 | r=inf | r=8.5
  (lora=A+B: the requests take the served LoRA adapters A and B in turn)
Prompts are random token ids (`input_ids`) with `ignore_eos`, so every request produces exactly
its output length. The client runs in several processes (asyncio, tritonclient.grpc.aio) so that
it is not the bottleneck; all timestamps are time.monotonic(), shared by the processes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from paged_llm.engine.step_times import KINDS as STEP_KINDS
from paged_llm.engine.step_times import StepTimes
from paged_llm.gc_pauses import LONG_PAUSE_S, process_gc_pauses
from paged_llm.testing import prometheus
from paged_llm.testing.bench_workload import (
    Job,
    RequestRecord,
    format_summary,
    infer_inputs,
    random_workload,
    run_offline,
    summarize,
    with_poisson_arrivals,
)

_PARAMETER = re.compile(r'key:\s*"([^"]+)"\s*,\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


# ------------------------------------------------------------------------------------ client side
# --grpc-like-openai: the return flags the OpenAI server sets on each request it forwards
_OPENAI_RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


def _inputs(job: Job, like_openai: bool = False) -> list[Any]:
    import tritonclient.grpc.aio as grpcclient

    sampling = {"max_tokens": job.num_output_tokens, "ignore_eos": True, "temperature": 0}
    if job.structured_outputs is not None:
        sampling["structured_outputs"] = job.structured_outputs
    if job.lora_name is not None:
        sampling["lora_name"] = job.lora_name
    arrays = [
        ("input_ids", np.asarray(job.prompt_token_ids, dtype=np.int32), "INT32"),
        ("stream", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
    ]
    if like_openai:
        arrays += [(name, np.array([True]), "BOOL") for name in _OPENAI_RETURN_FLAGS]
    return infer_inputs(grpcclient, arrays)


async def _one_request(client: Any, model: str, job: Job, text_only: bool) -> RequestRecord:
    import tritonclient.grpc.aio as grpcclient

    like_openai = os.environ.get("BENCH_GRPC_LIKE_OPENAI") == "1"
    request = {"model_name": model, "inputs": _inputs(job, like_openai), "request_id": str(job.index),
               "enable_empty_final_response": True}  # fmt: skip
    if text_only:
        request["outputs"] = [grpcclient.InferRequestedOutput("text_output")]
    elif like_openai:  # the outputs the OpenAI server asks for (plus output_ids, to count tokens)
        names = ("text_output", "output_ids", "num_output_tokens", "finish_reason", "num_input_tokens")
        request["outputs"] = [grpcclient.InferRequestedOutput(name) for name in names]
        request["parameters"] = {"paged_llm_totals_on_final": True}

    async def requests():
        yield request

    record = RequestRecord(job.index, time.monotonic())
    try:
        async for result, error in client.stream_infer(requests()):
            now = time.monotonic()
            if error is not None:
                record.error = str(error).splitlines()[0][:200]
                break
            if text_only:
                if result.as_numpy("text_output") is not None:  # a response per step, text or not
                    record.arrival_times.append(now)
            else:
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    record.arrival_times.append(now)
                    record.tokens_per_response.append(int(ids.size))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except Exception as error:  # the stream itself failed
        record.error = f"{type(error).__name__}: {error}"[:200]
    if text_only and record.error is None and record.arrival_times:
        # ignore_eos: a request that ended without error produced exactly its max_tokens; only the
        # mean tokens per response is reported, so spread them evenly over its responses.
        count, extra = divmod(job.num_output_tokens, len(record.arrival_times))
        record.tokens_per_response = [count + (i < extra) for i in range(len(record.arrival_times))]
    if record.error is None and not _expected_length(job, record.num_output_tokens):
        record.error = f"got {record.num_output_tokens} tokens, expected {job.num_output_tokens}"
    return record


_JSON = {"Content-Type": "application/json"}


async def _one_openai_request(session: Any, base_url: str, model: str, job: Job) -> RequestRecord:
    """The same job through the OpenAI server: /v1/completions, streamed (SSE), prompt as token ids.
    Each SSE event is one Triton response; tokens per response are spread evenly (as --text-only)."""
    body = {"model": job.lora_name or model, "prompt": job.prompt_token_ids,
            "max_tokens": job.num_output_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    # Serialized before the clock starts, as the gRPC client's inputs are built before it.
    data = json.dumps(body).encode()
    record = RequestRecord(job.index, time.monotonic())
    num_tokens = 0
    try:
        async with session.post(f"{base_url}/v1/completions", data=data, headers=_JSON) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = str(event["error"].get("message"))[:200]
                    break
                if event.get("choices"):
                    record.arrival_times.append(now)
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
    except Exception as error:  # the connection itself failed
        record.error = f"{type(error).__name__}: {error}"[:200]
    if record.error is None and record.arrival_times:
        count, extra = divmod(num_tokens, len(record.arrival_times))
        record.tokens_per_response = [count + (i < extra) for i in range(len(record.arrival_times))]
    if record.error is None and not _expected_length(job, record.num_output_tokens):
        record.error = f"got {record.num_output_tokens} tokens, expected {job.num_output_tokens}"
    return record


class _GcPauses:
    """The client's own garbage-collection pauses (a pause stalls every stream of the process)."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self._started = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses_s.append(time.perf_counter() - self._started)


async def _run_worker(
    url: str,
    model: str,
    jobs: list[Job],
    concurrency: int | None,
    gate: _StartGate,
    text_only: bool,
    pauses: _GcPauses,
):
    if url.startswith("http"):  # the OpenAI server
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )

        async def send(job: Job) -> RequestRecord:
            return await _one_openai_request(session, url, model, job)

        async def close() -> None:
            await session.close()
    else:
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(url)

        async def send(job: Job) -> RequestRecord:
            return await _one_request(client, model, job, text_only)

        async def close() -> None:
            await client.close()

    # Each lane's first request would otherwise pay for what the client sets up on first use (the
    # gRPC channel's connection, a pool connection, lazy imports): tens of ms in the TTFT of a
    # request the offline engine serves without it. With 8 processes of 2 lanes at concurrency 16
    # that was a quarter of the requests. One short request per lane, unmeasured, before the gate
    # opens (the parent reads the server's counters after it). gRPC multiplexes every request of
    # a process over one channel; aiohttp opens a connection per request in flight, so in request-
    # rate mode every request of the process is a lane. The prompt is the first job's reversed, so
    # no measured prompt finds its blocks in the prefix cache.
    if jobs:
        in_flight = concurrency if concurrency is not None else (len(jobs) if url.startswith("http") else 1)
        prompt, lora_name = jobs[0].prompt_token_ids[:8][::-1], jobs[0].lora_name
        num_warm = max(1, min(in_flight, len(jobs)))
        await asyncio.gather(*(send(Job(-1 - i, prompt, 2, lora_name=lora_name)) for i in range(num_warm)))
    # What exists now (modules, the channel) lives through the run: keep it out of the collections
    # that run during it, so a full collection in the client does not show up as a server ITL spike.
    gc.collect()
    gc.freeze()
    start_at = await asyncio.get_running_loop().run_in_executor(None, gate.wait_open)
    pauses.start()
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    try:
        if concurrency is None:  # request-rate mode: each job at its own offset

            async def timed(job: Job) -> RequestRecord:
                await asyncio.sleep(max(0.0, start_at + job.send_offset_s - time.monotonic()))
                return await send(job)

            return list(await asyncio.gather(*(timed(job) for job in jobs)))
        queue = list(jobs)
        records: list[RequestRecord] = []

        async def lane() -> None:
            while queue:
                records.append(await send(queue.pop(0)))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return records
    finally:
        await close()


class _StartGate:
    """Client processes report ready (connected, warmed up), then all start sending at one time the
    parent sets after its own preparations (reading the server's counters)."""

    _TIMEOUT_S = 300.0

    def __init__(self, context: Any, num_processes: int) -> None:
        self._ready = context.Barrier(num_processes + 1)
        self._open = context.Barrier(num_processes + 1)
        self._start_at = context.Value("d", 0.0)

    def wait_open(self) -> float:
        """In a client process: ready, then wait for the start time."""
        self._ready.wait(self._TIMEOUT_S)
        self._open.wait(self._TIMEOUT_S)
        return self._start_at.value

    def open(self, before_start: Callable[[], None] | None) -> None:
        """In the parent: once every client process is ready, run `before_start`, then let them go."""
        try:
            self._ready.wait(self._TIMEOUT_S)
            if before_start is not None:
                before_start()
            # time.monotonic() is system-wide on Linux; the margin covers the processes' wake-up
            self._start_at.value = time.monotonic() + 0.1
            self._open.wait(self._TIMEOUT_S)
        except BaseException:
            self.abort()  # the client processes stop waiting at once, not after the timeout
            raise

    def abort(self) -> None:
        self._ready.abort()
        self._open.abort()


def _worker_main(url, model, jobs, concurrency, gate, text_only, results) -> None:
    pauses = _GcPauses()
    try:
        records = asyncio.run(_run_worker(url, model, jobs, concurrency, gate, text_only, pauses))
    except BaseException:
        gate.abort()  # the parent and the other processes fail at once instead of timing out
        raise
    results.put(([{**asdict(r), "endpoint": url} for r in records], pauses.pauses_s))


def run_served(
    url: str | list[str],
    model: str,
    jobs: list[Job],
    concurrency: int | None,
    num_processes: int,
    text_only: bool = False,
    before_start: Callable[[], None] | None = None,
) -> tuple[list[RequestRecord], dict[str, float]]:
    """Splits the jobs (and the concurrency) over client processes and gathers their records and
    the client processes' garbage-collection pauses (count, longest, total). With several URLs the
    processes take them in turn (each record says its endpoint). `before_start` runs once every
    client process has connected and warmed up, just before the measured requests go out."""
    urls = [url] if isinstance(url, str) else url
    if concurrency is not None:
        num_processes = max(1, min(num_processes, concurrency))
    num_processes = max(1, min(num_processes, len(jobs)))
    context = mp.get_context("spawn")
    results = context.Queue()
    gate = _StartGate(context, num_processes)
    workers = []
    for index in range(num_processes):
        share = jobs[index::num_processes]
        lanes = None if concurrency is None else len(range(index, concurrency, num_processes))
        worker = context.Process(
            target=_worker_main,
            args=(urls[index % len(urls)], model, share, lanes, gate, text_only, results),
        )
        worker.start()
        workers.append(worker)
    gate.open(before_start)
    records: list[RequestRecord] = []
    pauses_s: list[float] = []
    for _ in workers:
        worker_records, worker_pauses_s = results.get()
        records += [RequestRecord(**r) for r in worker_records]
        pauses_s += worker_pauses_s
    for worker in workers:
        worker.join()
    client_gc = {"num_collections": len(pauses_s), "max_pause_ms": 1e3 * max(pauses_s, default=0.0),
                 "total_pause_ms": 1e3 * sum(pauses_s)}  # fmt: skip
    return sorted(records, key=lambda r: r.index), client_gc


# ------------------------------------------------------------------------------------ server side
def read_llm_parameters(repository: Path) -> dict[str, str]:
    """The `parameters` of REPOSITORY/llm/config.pbtxt (the engine settings the server uses)."""
    return dict(_PARAMETER.findall((repository / "llm" / "config.pbtxt").read_text()))


def _expected_length(job: Job, num_output_tokens: int) -> bool:
    """ignore_eos: exactly max_tokens; but a constrained request ends where its grammar ends."""
    if job.structured_outputs is not None:
        return 0 < num_output_tokens <= job.num_output_tokens
    return num_output_tokens == job.num_output_tokens


def offline_engine(repository: Path, model_dir: str | None, core_mode: str):
    from paged_llm.config import EngineConfig
    from paged_llm.engine.llm_engine import LLMEngine
    from paged_llm.models.builtin import resolve_model_dir

    config = EngineConfig.from_parameters(read_llm_parameters(repository))
    model = model_dir or str(resolve_model_dir(config.model.model, repository / "llm"))
    return LLMEngine(
        replace(config, model=replace(config.model, model=model)), show_progress=False, core_mode=core_mode
    )


@dataclass(frozen=True)
class Run:
    label: str
    scenario: str
    jobs: list[Job]
    concurrency: int | None  # None: request-rate mode
    request_rate: float


def _runs(
    name: str,
    num: int,
    input_len: str,
    output_len: str,
    load: str,
    args: argparse.Namespace,
    first_index: int,
    lora_names: list[str] | None = None,
) -> list[Run]:
    """One run per concurrency level (c=1,2,4) or one Poisson run (r=RATE). Every run gets prompts
    of its own (seeded by --seed and the run's index in the invocation): a run that repeated an
    earlier run's prompts would be served from the prefix cache and report a TTFT of cache hits.
    `lora_names`: the requests take these adapters in turn."""

    def jobs(index: int) -> list[Job]:
        made = random_workload(num, input_len, output_len, args.vocab_limit, args.seed + 1_000_003 * index)
        if lora_names:
            made = [replace(job, lora_name=lora_names[i % len(lora_names)]) for i, job in enumerate(made)]
        return made

    kind, _, value = load.partition("=")
    if kind == "c":
        return [
            Run(f"{name}, concurrency {c}", name, jobs(first_index + i), int(c), float("inf"))
            for i, c in enumerate(value.split(","))
        ]
    rate = float(value)
    arrivals = with_poisson_arrivals(jobs(first_index), rate, args.seed)
    return [Run(f"{name}, request rate {value}", name, arrivals, None, rate)]


def plan_runs(args: argparse.Namespace) -> list[Run]:
    if args.scenario:
        runs: list[Run] = []
        for spec in args.scenario:
            name, num, input_len, output_len, load, *rest = spec.split(":", 5)
            lora_names = None
            if rest:
                key, _, value = rest[0].partition("=")
                if key != "lora" or not value:
                    raise SystemExit(f"--scenario {spec!r}: the sixth field is lora=NAME+NAME...")
                lora_names = value.split("+")
            runs += _runs(name, int(num), input_len, output_len, load, args, len(runs), lora_names)
        return runs
    load = f"c={args.concurrency}" if args.concurrency else f"r={args.request_rate}"
    return _runs("workload", args.num_prompts, args.input_len, args.output_len, load, args, 0)


def _profile_stub(server: Any, path: Path | None) -> Any:
    """Starts py-spy on the server's Python stub for the first seconds of a run (None if not asked)."""
    import shutil
    import subprocess

    import psutil

    if path is None:
        return None
    stubs = [p for p in psutil.Process(server.process.pid).children() if "stub" in p.name()]
    if not stubs or shutil.which("py-spy") is None:
        print("--profile-stub: no stub process or no py-spy on PATH; not profiling", file=sys.stderr)
        return None
    command = ["py-spy", "record", "--pid", str(stubs[0].pid), "--duration", "8", "--rate", "250",
               "--gil", "--format", "speedscope", "--output", str(path)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _server_ttft(server: Any) -> tuple[float, float] | None:
    """(sum of seconds, count) of the stubs' time-to-first-token histogram: from a request's
    arrival in a stub's execute() to its first token processed there (all series added up)."""
    if server is None:
        return None
    samples = prometheus.parse(server.metrics())
    name = "paged_llm_time_to_first_token_seconds"
    return prometheus.total(samples, f"{name}_sum"), prometheus.total(samples, f"{name}_count")


def _server_ttft_mean_ms(server: Any, before: tuple[float, float] | None) -> float | None:
    """The stubs' mean TTFT (arrival to first token) of the requests since `before`."""
    if before is None:
        return None
    time.sleep(1.0)  # the stubs flush their histograms every ~0.5 s
    after = _server_ttft(server)
    assert after is not None
    num_firsts = after[1] - before[1]
    return 1e3 * (after[0] - before[0]) / num_firsts if num_firsts > 0 else None


_HISTOGRAM_TOTALS = (
    "paged_llm_generation_tokens_total",
    "paged_llm_histogram_observations_dropped_total",
    "paged_llm_time_to_first_token_seconds_count",
    "paged_llm_inter_token_latency_seconds_count",
)


class ServerBefore(dict):
    """The server's counters before a run (`counters`, `ttft`, `histograms`, and the engine's
    `steps`): run_served's start gate calls it once every client has sent its warm-up request, so
    the warm-ups stay out of every figure taken against it. Without a server every entry is None."""

    def __init__(self, server: Any) -> None:
        super().__init__()
        self.server = server

    def __call__(self) -> None:
        steps = None
        if self.server is not None:
            # The stubs refresh the engine's counters (GC, cancellation polls, steps) every ~0.5 s:
            # wait for the warm-up requests' to land before the snapshot.
            steps = server_engine_figures(self.server, settle_s=1.0)
        self.update(counters=_server_counters(self.server), ttft=_server_ttft(self.server),
                    histograms=_histogram_totals(self.server), steps=steps)  # fmt: skip


def _histogram_totals(server: Any) -> dict[str, float] | None:
    if server is None:
        return None
    samples = prometheus.parse(server.metrics())
    return {name: prometheus.total(samples, name) for name in _HISTOGRAM_TOTALS}


def _total_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(f"paged_llm_{name}", 0.0) - before.get(f"paged_llm_{name}", 0.0)


def _histogram_lag(server: Any, before: dict[str, float] | None, limit_s: float = 30.0) -> dict | None:
    """How long after a run the stubs' histograms took to count all of its tokens (they are sent on a
    thread of their own, and under load they trail the counters): each token is one first-token or
    one inter-token observation (n=1 requests). None without a launched server."""
    if server is None or before is None:
        return None
    start = time.monotonic()
    while True:
        after = _histogram_totals(server)
        assert after is not None
        delta = functools.partial(_total_delta, before, after)
        observed = delta("time_to_first_token_seconds_count") + delta("inter_token_latency_seconds_count")
        tokens = delta("generation_tokens_total")
        waited_s = time.monotonic() - start
        if observed >= tokens or waited_s > limit_s:
            return {
                "settled_after_s": waited_s if observed >= tokens else None,
                "num_tokens": tokens,
                "num_observed": observed,
                "num_dropped": delta("histogram_observations_dropped_total"),
            }
        time.sleep(0.05)


@dataclass(frozen=True)
class EngineFigures:
    """The engine core's busy step periods and its grammar mask fills (totals since start)."""

    steps: StepTimes
    mask_fills: float = 0.0
    mask_fill_s: float = 0.0
    mask_wait_s: float = 0.0


def server_engine_figures(server: Any, settle_s: float = 1.0) -> EngineFigures:
    """EngineFigures from a launched server's /metrics (all series added up), after `settle_s`
    (the stubs refresh them every ~0.5 s)."""
    time.sleep(settle_s)
    samples = prometheus.parse(server.metrics())

    def steps(what: str, kind: str) -> float:
        return prometheus.total(samples, f"paged_llm_engine_{what}_total", kind=kind)

    def masks(what: str) -> float:
        return prometheus.total(samples, f"paged_llm_grammar_mask_{what}_total")

    return EngineFigures(
        StepTimes(
            int(steps("steps", "decode")),
            steps("step_seconds", "decode"),
            int(steps("steps", "prefill")),
            steps("step_seconds", "prefill"),
        ),
        masks("fills"),
        masks("fill_seconds"),
        masks("wait_seconds"),
    )


def engine_figures(engine: Any) -> EngineFigures:
    """The same from an in-process LLMEngine's stats."""
    snapshot = engine.stats.snapshot()
    masks = snapshot.structured_output
    return EngineFigures(
        snapshot.engine_steps, masks.num_mask_fills, masks.mask_fill_seconds, masks.mask_wait_seconds
    )


def step_means(before: EngineFigures, after: EngineFigures) -> dict[str, dict[str, float | None]]:
    """Per step kind, the steps between two readings and their mean period in ms; the grammar mask
    fills between them, with the mean fill and the engine thread's mean wait a fill, in ms."""
    means: dict[str, dict[str, float | None]] = {}
    for kind in STEP_KINDS:
        num_before, seconds_before = before.steps.count_and_seconds(kind)
        num_after, seconds_after = after.steps.count_and_seconds(kind)
        num_steps = num_after - num_before
        mean_ms = 1e3 * (seconds_after - seconds_before) / num_steps if num_steps else None
        means[kind] = {"num_steps": num_steps, "mean_ms": mean_ms}
    fills = after.mask_fills - before.mask_fills
    means["mask"] = {
        "num_fills": fills,
        "fill_ms": 1e3 * (after.mask_fill_s - before.mask_fill_s) / fills if fills else None,
        "wait_ms": 1e3 * (after.mask_wait_s - before.mask_wait_s) / fills if fills else None,
    }
    return means


def gap_over_step(summary: dict[str, Any]) -> dict[str, float] | None:
    """A stream's longest gap after its first token against the engine's mean busy step (decode and
    prefill steps together) over the same run: issue 45's flood measure (p99 <= 2, max <= 4)."""
    steps, gaps = summary.get("engine_steps"), summary.get("longest_gap_ms")
    if not steps or not gaps:
        return None
    num_steps = sum(steps[kind]["num_steps"] or 0 for kind in STEP_KINDS)
    total_ms = sum((steps[kind]["mean_ms"] or 0.0) * (steps[kind]["num_steps"] or 0) for kind in STEP_KINDS)
    if not num_steps or not total_ms:
        return None
    mean_step_ms = total_ms / num_steps
    ratios = {key: gaps[key] / mean_step_ms for key in ("p50", "p99", "max") if gaps.get(key) is not None}
    return {"mean_step_ms": mean_step_ms, **ratios} if len(ratios) == 3 else None


def print_step_figures(summary: dict[str, Any]) -> None:
    if summary.get("engine_steps"):
        print(f"   engine steps: {format_step_means(summary['engine_steps'])}", flush=True)
    ratio = summary.get("longest_gap_over_step")
    if ratio:
        print(
            f"   a stream's longest gap / the mean engine step ({ratio['mean_step_ms']:.2f} ms): "
            f"p50 {ratio['p50']:.2f}, p99 {ratio['p99']:.2f}, max {ratio['max']:.2f}",
            flush=True,
        )


def format_step_means(means: dict[str, dict[str, float | None]]) -> str:
    parts = []
    for kind in STEP_KINDS:
        m = means[kind]
        parts.append(
            f"{kind} {int(m['num_steps'] or 0)} x {m['mean_ms']:.3f} ms" if m["mean_ms"] else f"{kind} none"
        )
    mask = means.get("mask")
    if mask and mask["num_fills"]:
        parts.append(
            f"masks {int(mask['num_fills'])}: fill {mask['fill_ms']:.3f} ms, waited {mask['wait_ms']:.3f} ms"
        )
    return ", ".join(parts)


_SERVER_COUNTERS = tuple(
    f"paged_llm_{name}_total"
    for name in (
        "cancellation_checks",
        "cancellation_check_seconds",
        "engine_gc_collections",
        "engine_gc_pause_seconds",
        "engine_gc_long_pauses",
    )
)


def _server_counters(server: Any) -> dict[str, float] | None:
    """The stub's cancellation-polling and the engine core's GC counters from a launched server's
    /metrics (and `now`), else None."""
    if server is None:
        return None
    samples = prometheus.parse(server.metrics())
    values = {name: prometheus.total(samples, name) for name in _SERVER_COUNTERS}
    values["now"] = time.monotonic()
    return values


def _poll_delta(before: Any, after: Any) -> dict[str, float] | None:
    """The stub's cancellation polling during one run: what each is_cancelled() round trip cost.
    (The stub updates the counters every few seconds: short runs under-count slightly.)"""
    key, seconds_key = "paged_llm_cancellation_checks_total", "paged_llm_cancellation_check_seconds_total"
    if before is None or after is None or after.get(key, 0.0) <= before.get(key, 0.0):
        return None
    num_checks = after[key] - before[key]
    seconds = after[seconds_key] - before[seconds_key]
    return {
        "num_checks": num_checks,
        "us_per_check": 1e6 * seconds / num_checks,
        "busy_share": seconds / (after["now"] - before["now"]),
    }


def _engine_gc_delta(before: Any, after: Any) -> dict[str, float] | None:
    """The engine core's garbage collections during one run (from the server's counters)."""
    if before is None or after is None or "paged_llm_engine_gc_collections_total" not in after:
        return None

    def delta(name: str) -> float:
        return after.get(f"paged_llm_engine_gc_{name}_total", 0.0) - before.get(
            f"paged_llm_engine_gc_{name}_total", 0.0
        )

    return {
        "num_collections": delta("collections"),
        "pause_ms": 1e3 * delta("pause_seconds"),
        "num_long_pauses": delta("long_pauses"),
    }


def _format_gc(label: str, num_collections: float, pause_ms: float, num_long_pauses: float) -> str:
    return (
        f"   {label}: {num_collections:.0f} collections, {pause_ms:.1f} ms in all, "
        f"{num_long_pauses:.0f} of {LONG_PAUSE_S * 1e3:g} ms or more"
    )


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        if result["concurrency"] is not None:
            by_scenario.setdefault(result["scenario"], []).append(result)
    points = max(by_scenario.values(), key=len, default=[])  # the sweep
    if len(points) < 2:
        return
    concurrency = [r["concurrency"] for r in points]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, metric, title in (
        (axes[0], "ttft_ms", "time to first token"),
        (axes[1], "itl_ms", "inter-token latency"),
    ):
        for source, style in (("served", "-o"), ("offline", "--s")):
            series = [r[source][metric] for r in points if r.get(source)]
            if len(series) != len(points):
                continue
            for percentile in ("p50", "p99"):
                axis.plot(concurrency, [s[percentile] for s in series], style, label=f"{source} {percentile}")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel("ms")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _start_openai_server(
    grpc_url: str, model: str, num_workers: int, http_url: str | None = None
) -> tuple[Any, str]:
    """The OpenAI server (python -m paged_llm.openai) in front of `grpc_url` (generation requests
    over Triton's HTTP generate_stream when `http_url` is given), once healthy."""
    import subprocess
    import urllib.request

    from paged_llm.testing.server_process import free_ports

    [port] = free_ports(1)
    process = subprocess.Popen(
        [sys.executable, "-m", "paged_llm.openai", "--triton-url", grpc_url, "--port", str(port),
         "--health-model", model, "--workers", str(num_workers),
         *(["--triton-http-url", http_url] if http_url else [])]
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return process, base_url
        except OSError:
            time.sleep(0.25)
    process.kill()
    raise RuntimeError("the OpenAI server did not become healthy")


def _other_tokens(jobs: list[Job], vocab_limit: int) -> list[Job]:
    """The same lengths with other token ids: no prefix-cache hit on what an earlier run sent."""
    return [replace(j, prompt_token_ids=[(t + 7919) % vocab_limit for t in j.prompt_token_ids]) for j in jobs]


def _mixed_run(run: Run, url: str, openai_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Direct gRPC and the OpenAI server in one run: the client processes alternate between them."""
    if args.client_processes % 2:
        raise SystemExit("--endpoint mixed needs an even --client-processes")
    records, _ = run_served(
        [url, openai_url], args.model, run.jobs, run.concurrency, args.client_processes, args.text_only
    )
    grpc = summarize([r for r in records if r.endpoint == url])
    openai = summarize([r for r in records if r.endpoint == openai_url])
    added = _openai_added(grpc, openai)
    print(format_summary(f"served, direct gRPC half, {run.label}", grpc), flush=True)
    print(format_summary(f"served, OpenAI half, {run.label}", openai), flush=True)
    print(
        f"   OpenAI path adds (same run): TTFT p50 {added['ttft_p50_ms']:+.2f} ms (target <= 2), "
        f"ITL p50 {added['itl_p50_ratio'] - 1:+.1%} (target <= 10%)",
        flush=True,
    )
    return {"label": run.label, "scenario": run.scenario, "concurrency": run.concurrency,
            "request_rate": run.request_rate, "endpoint": "mixed", "served": grpc,
            "served_openai": openai, "openai_added": added}  # fmt: skip


def _openai_added(grpc: dict[str, Any], openai: dict[str, Any]) -> dict[str, float]:
    """The OpenAI run's figures minus direct gRPC's; with the stubs' TTFT histogram, the TTFT mean
    split into the part spent in the stub (arrival to first token: the engine's batching) and the
    part outside it (the client, the transport, the OpenAI server)."""
    added = {
        "ttft_p50_ms": openai["ttft_ms"]["p50"] - grpc["ttft_ms"]["p50"],
        "itl_p50_ratio": openai["itl_ms"]["p50"] / grpc["itl_ms"]["p50"]
        if grpc["itl_ms"]["p50"]
        else float("nan"),
    }
    stub_grpc, stub_openai = grpc.get("server_ttft_mean_ms"), openai.get("server_ttft_mean_ms")
    if stub_grpc is not None and stub_openai is not None:
        added["stub_ttft_mean_ms"] = stub_openai - stub_grpc
        added["outside_stub_ttft_mean_ms"] = (openai["ttft_ms"]["mean"] - stub_openai) - (
            grpc["ttft_ms"]["mean"] - stub_grpc
        )
    return added


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="gRPC address of a running tritonserver, e.g. 127.0.0.1:8001")
    target.add_argument(
        "--launch", type=Path, help="start tritonserver on this model repository, stop it after"
    )
    parser.add_argument("--model", default="llm", help="Triton model name (vllm_backend request interface)")
    parser.add_argument(
        "--endpoint",
        choices=("grpc", "openai", "both", "mixed"),
        default="grpc",
        help="send through Triton's gRPC streaming, the OpenAI server (/v1/completions, SSE), or both in "
        "turn on the same server (the OpenAI run gets other prompt tokens of the same lengths, so the "
        "prefix cache does not favour it), with the OpenAI path's added TTFT and ITL; `mixed`: both at "
        "once, half the client processes (and streams) each, so that both meet the same engine steps "
        "(a scenario's c=128 gives each endpoint 64 streams)",
    )
    parser.add_argument(
        "--grpc-like-openai",
        action="store_true",
        help="direct gRPC requests carry the return flags and requested outputs the OpenAI server uses "
        "(separates the cost of those outputs in the stub from the cost of the OpenAI hop)",
    )
    parser.add_argument(
        "--openai-url", help="base URL of a running OpenAI server (default: one is started in front of --url)"
    )
    parser.add_argument(
        "--openai-workers",
        type=int,
        default=max(1, min(6, (os.cpu_count() or 1) // 2)),
        help="processes of the OpenAI server this script starts (as `paged-llm serve` picks them)",
    )
    parser.add_argument(
        "--openai-transport",
        choices=("http", "grpc"),
        default="http",
        help="how the OpenAI server this script starts reaches Triton (as `paged-llm serve "
        "--openai-transport`): HTTP generate_stream (default) or gRPC streaming",
    )
    parser.add_argument(
        "--triton-http-url", help="Triton's HTTP host:port (--openai-transport http without --launch)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="128:128", help="uniform range, e.g. 100:1024")
    parser.add_argument("--output-len", default="128:128", help="uniform range, e.g. 100:1024")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="requests in flight, or a comma-separated sweep: 1,2,4,8,16")
    load.add_argument("--request-rate", default="inf", help="Poisson arrivals per second; inf = all at once")
    parser.add_argument(
        "--scenario",
        action="append",
        help="NAME:NUM_PROMPTS:INPUT_LEN:OUTPUT_LEN:LOAD[:lora=A+B] (repeatable)",
    )
    parser.add_argument("--vocab-limit", type=int, default=32000, help="prompt token ids are below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text-only",
        action="store_true",
        help="ask for text_output only (a client that names no outputs gets every output of the model, "
        "output_ids included); tokens per response is then the expected count over the responses",
    )
    parser.add_argument("--warmup", type=int, default=8, help="short requests first, not measured")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="client processes sharing the streams (a Python gRPC client is itself a bottleneck at "
        "thousands of responses/s: 4 gave 14.4k tok/s and 2.58 tokens/response where 8 gave 15.2k, 2.31)",
    )
    parser.add_argument(
        "--compare-offline",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL_DIR",
        help="then run the offline engine on the same workload (settings from the llm model's "
        "config.pbtxt in --model-repository / --launch; MODEL_DIR overrides its model)",
    )
    parser.add_argument(
        "--offline-core-mode",
        choices=("auto", "inprocess", "process"),
        default="auto",
        help="--compare-offline runs the engine core in this process or in its own, as served (auto: "
        "its own on an accelerator, as bench_offline.py does)",
    )
    parser.add_argument("--model-repository", type=Path, help="the served repository (for --compare-offline)")
    parser.add_argument("--server-log", type=Path, help="with --launch: keep the server log here")
    parser.add_argument(
        "--profile-stub",
        type=Path,
        help="with --launch: py-spy the Triton stub during the first run, GIL holders "
        "only; writes a speedscope JSON here",
    )
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--plot", type=Path, help="PNG of TTFT and ITL against concurrency (a sweep)")
    args = parser.parse_args()
    repository = args.model_repository or args.launch
    if args.compare_offline is not None and repository is None:
        parser.error("--compare-offline needs --model-repository (or --launch) for the engine settings")

    if args.grpc_like_openai:  # read by the client processes (spawned: they get the environment)
        os.environ["BENCH_GRPC_LIKE_OPENAI"] = "1"
    runs = plan_runs(args)
    warmup = [Job(-1 - i, j.prompt_token_ids[:16], 4) for i, j in enumerate(runs[0].jobs[: args.warmup])]
    results: list[dict[str, Any]] = []
    server = None
    if args.launch:
        from paged_llm.testing.server_process import start_server

        log_path = args.server_log or Path(tempfile.mkdtemp(prefix="bench_serving.")) / "server.log"
        print(f"starting tritonserver on {args.launch} (log: {log_path})", file=sys.stderr)
        server = start_server(args.launch.resolve(), log_path, timeout_s=1800.0)
    url = server.grpc_url if server else args.url
    openai_server = None
    openai_url = args.openai_url
    if args.endpoint != "grpc" and openai_url is None:
        http_url = None
        if args.openai_transport == "http":
            if server is None and args.triton_http_url is None:
                parser.error("--openai-transport http needs --triton-http-url (or --launch)")
            http_url = server.http_url if server else args.triton_http_url
        openai_server, openai_url = _start_openai_server(url, args.model, args.openai_workers, http_url)
    try:
        if warmup:
            run_served(url, args.model, warmup, len(warmup), 1)
            if openai_url:
                run_served(openai_url, args.model, warmup, len(warmup), 1)
        for index, run in enumerate(tqdm(runs, desc="served", unit="run")):
            if args.endpoint == "openai":
                run = replace(run, jobs=_other_tokens(run.jobs, args.vocab_limit))
            if args.endpoint == "mixed":
                results.append(_mixed_run(run, url, openai_url, args))
                continue
            profiler = _profile_stub(server, args.profile_stub) if index == 0 and server else None
            before = ServerBefore(server)
            served, client_gc = run_served(
                openai_url if args.endpoint == "openai" else url,
                args.model,
                run.jobs,
                run.concurrency,
                args.client_processes,
                args.text_only,
                before_start=before,
            )
            summary = summarize(served)
            summary["client_gc"] = client_gc
            if profiler is not None:
                profiler.wait()
            counters_after = _server_counters(server)
            summary["histogram_lag"] = _histogram_lag(server, before["histograms"])
            summary["cancellation_polls"] = _poll_delta(before["counters"], counters_after)
            summary["engine_gc"] = _engine_gc_delta(before["counters"], counters_after)
            summary["server_ttft_mean_ms"] = _server_ttft_mean_ms(server, before["ttft"])
            if server is not None:  # after the histograms' lag: the counters are as fresh
                summary["engine_steps"] = step_means(before["steps"], server_engine_figures(server, 0.6))
                summary["longest_gap_over_step"] = gap_over_step(summary)
            results.append(
                {"label": run.label, "scenario": run.scenario, "concurrency": run.concurrency,
                 "request_rate": run.request_rate, "served": summary}
            )  # fmt: skip
            print(format_summary(f"served, {run.label}", summary), flush=True)
            print(
                f"   client GC: {client_gc['num_collections']} collections, longest "
                f"{client_gc['max_pause_ms']:.2f} ms, {client_gc['total_pause_ms']:.1f} ms in all",
                flush=True,
            )
            if summary["cancellation_polls"]:
                polls = summary["cancellation_polls"]
                print(
                    f"   is_cancelled(): {polls['num_checks']} checks, {polls['us_per_check']:.1f} us each, "
                    f"{polls['busy_share']:.2%} of the run in one thread",
                    flush=True,
                )
            if summary["engine_gc"]:
                print(_format_gc("engine core GC", **summary["engine_gc"]), flush=True)
            if summary["histogram_lag"]:
                lag = summary["histogram_lag"]
                settled = lag["settled_after_s"]
                print(
                    f"   histograms: {lag['num_observed']:.0f} of {lag['num_tokens']:.0f} tokens observed "
                    + (f"{settled:.2f} s after the run" if settled is not None else "(not within 30 s)")
                    + f", {lag['num_dropped']:.0f} dropped",
                    flush=True,
                )
            print_step_figures(summary)
            if summary["server_ttft_mean_ms"] is not None:
                print(
                    f"   TTFT mean: {summary['ttft_ms']['mean']:.2f} ms at the client, "
                    f"{summary['server_ttft_mean_ms']:.2f} ms from arrival in the stub to the first token "
                    "processed there",
                    flush=True,
                )
            if args.endpoint == "both":
                openai_before = ServerBefore(server)
                via_openai, _ = run_served(
                    openai_url, args.model, _other_tokens(run.jobs, args.vocab_limit), run.concurrency,
                    args.client_processes,
                    before_start=openai_before,
                )  # fmt: skip
                openai_summary = summarize(via_openai)
                openai_summary["server_ttft_mean_ms"] = _server_ttft_mean_ms(server, openai_before["ttft"])
                results[-1]["served_openai"] = openai_summary
                results[-1]["openai_added"] = _openai_added(summary, openai_summary)
                print(
                    format_summary(f"served via the OpenAI server, {run.label}", openai_summary), flush=True
                )
                added = results[-1]["openai_added"]
                print(
                    f"   OpenAI path adds: TTFT p50 {added['ttft_p50_ms']:+.2f} ms (target <= 2), "
                    f"ITL p50 {added['itl_p50_ratio'] - 1:+.1%} (target <= 10%)",
                    flush=True,
                )
                if "stub_ttft_mean_ms" in added:
                    in_stub, outside = added["stub_ttft_mean_ms"], added["outside_stub_ttft_mean_ms"]
                    print(
                        f"   TTFT mean in the stub (arrival to first token) {in_stub:+.2f} ms, "
                        f"outside it (client, transport, OpenAI server) {outside:+.2f} ms",
                        flush=True,
                    )
    finally:
        if openai_server is not None:
            openai_server.terminate()
            openai_server.wait(timeout=30)
        if server is not None:
            server.stop()
    if args.compare_offline is not None:
        engine = offline_engine(repository, args.compare_offline or None, args.offline_core_mode)
        print(f"offline engine: core {engine.core_mode}", flush=True)
        run_offline(engine, warmup, None)
        for run, result in tqdm(list(zip(runs, results)), desc="offline", unit="run"):
            gc_before, steps_before = process_gc_pauses(), engine_figures(engine)
            summary = summarize(run_offline(engine, run.jobs, run.concurrency))
            summary["engine_steps"] = step_means(steps_before, engine_figures(engine))
            summary["longest_gap_over_step"] = gap_over_step(summary)
            if engine.core_mode == "inprocess":  # the engine's collections are this process's
                pauses = process_gc_pauses().since(gc_before)
                summary["engine_gc"] = {"num_collections": pauses.num_collections,
                                        "pause_ms": 1e3 * pauses.pause_s_total,
                                        "num_long_pauses": pauses.num_long_pauses}  # fmt: skip
            result["offline"] = summary
            result["served_over_offline"] = (
                result["served"]["output_tokens_per_s"] / summary["output_tokens_per_s"]
            )
            print(format_summary(f"offline, {run.label}", summary))
            print_step_figures(summary)
            if summary.get("engine_gc"):
                print(_format_gc("offline engine GC (this process)", **summary["engine_gc"]))
            served_tpot, offline_tpot = result["served"]["tpot_ms"]["p50"], summary["tpot_ms"]["p50"]
            if served_tpot and offline_tpot:
                result["tpot_p50_served_over_offline"] = served_tpot / offline_tpot
            tpot = result.get("tpot_p50_served_over_offline")
            print(
                f"  served / offline: output tok/s {result['served_over_offline']:.3f}"
                + (f", TPOT p50 {tpot:.3f}" if tpot else ""),
                flush=True,
            )
        engine.shutdown()
    if args.json:
        payload = {"argv": sys.argv, "machine": platform.node(), "results": results}
        args.json.write_text(json.dumps(payload, indent=2))
    if args.plot:
        _plot(results, args.plot)
    errors = sum(r["served"]["num_errors"] + r.get("served_openai", {}).get("num_errors", 0) for r in results)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
