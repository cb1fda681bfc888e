"""What the benchmarks share: the random-token workload, per-request timing records and their
summary (vLLM's benchmark_serving metrics), and an offline driver of the engine that produces the
same records, so served and offline numbers come out of one definition.

Definitions (per request; the summary takes percentiles over requests or gaps):
  TTFT    first response with a token - send time
  TPOT    (last token's arrival - first token's arrival) / (output tokens - 1)
  ITL     gaps between consecutive responses of a stream (a merged response is one gap)
  tokens per response = output tokens / data responses
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np


def cpu_model_name() -> str | None:
    """The host CPU's model name from /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def infer_inputs(grpcclient: Any, arrays: list[tuple[str, np.ndarray, str]]) -> list[Any]:
    """(name, array, Triton datatype) -> InferInput tensors of `grpcclient` (tritonclient.grpc or its
    .aio: both have InferInput)."""
    inputs = []
    for name, array, datatype in arrays:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass(frozen=True)
class Job:
    index: int
    prompt_token_ids: list[int]
    num_output_tokens: int
    send_offset_s: float = 0.0  # request-rate mode: when to send, from the start
    structured_outputs: dict[str, Any] | None = None  # the request's constraint (bench_structured.py)
    lora_name: str | None = None  # the request's LoRA adapter (None: the base model)


@dataclass
class RequestRecord:
    index: int
    send_time: float  # time.monotonic()
    arrival_times: list[float] = field(default_factory=list)  # one per response carrying tokens
    tokens_per_response: list[int] = field(default_factory=list)
    error: str | None = None
    endpoint: str = ""  # where it was sent (bench_serving --endpoint mixed)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.tokens_per_response)


def parse_range(text: str) -> tuple[int, int]:
    """`N`, `LOW:HIGH` or `LOW-HIGH` (inclusive)."""
    low, _, high = text.replace("-", ":").partition(":")
    return int(low), int(high or low)


def random_workload(
    num_requests: int, input_len: str, output_len: str, vocab_limit: int, seed: int = 0
) -> list[Job]:
    """Random prompt token ids and output lengths, each uniform in its range (nano-vllm's workload)."""
    rng = random.Random(seed)
    in_low, in_high = parse_range(input_len)
    out_low, out_high = parse_range(output_len)
    jobs = []
    for index in range(num_requests):
        prompt = [rng.randrange(0, vocab_limit) for _ in range(rng.randint(in_low, in_high))]
        jobs.append(Job(index, prompt, rng.randint(out_low, out_high)))
    return jobs


def with_poisson_arrivals(jobs: list[Job], request_rate: float, seed: int = 0) -> list[Job]:
    """Send offsets of a Poisson process at `request_rate` requests/s (inf: all at once)."""
    if request_rate == float("inf"):
        return jobs
    rng = random.Random(seed + 1)
    offset, timed = 0.0, []
    for job in jobs:
        timed.append(replace(job, send_offset_s=offset))
        offset += rng.expovariate(request_rate)
    return timed


def _percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    array = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "max": float(array.max()),
    }


def summarize(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.arrival_times]
    start = min((r.send_time for r in records), default=0.0)
    end = max((r.arrival_times[-1] for r in ok), default=start)
    elapsed = max(end - start, 1e-9)
    total_tokens = sum(r.num_output_tokens for r in ok)
    ttft = [r.arrival_times[0] - r.send_time for r in ok]
    tpot = [
        (r.arrival_times[-1] - r.arrival_times[0]) / (r.num_output_tokens - 1)
        for r in ok
        if r.num_output_tokens > 1
    ]
    itl = [b - a for r in ok for a, b in zip(r.arrival_times, r.arrival_times[1:])]
    # A stream's longest wait between two of its responses: one stall that hits every stream shows
    # here at every percentile, where the ITL distribution would hide it in its tail.
    longest_gap = [
        max(b - a for a, b in zip(r.arrival_times, r.arrival_times[1:]))
        for r in ok
        if len(r.arrival_times) > 1
    ]
    num_responses = sum(len(r.tokens_per_response) for r in ok)
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error is not None})[:5],
        "elapsed_s": elapsed,
        "output_tokens": total_tokens,
        "output_tokens_per_s": total_tokens / elapsed,
        "requests_per_s": len(ok) / elapsed,
        "tokens_per_response": total_tokens / num_responses if num_responses else None,
        "ttft_ms": _percentiles(ttft, 1e3),
        "tpot_ms": _percentiles(tpot, 1e3),
        "itl_ms": _percentiles(itl, 1e3),
        "longest_gap_ms": _percentiles(longest_gap, 1e3),
    }


def format_summary(label: str, summary: dict[str, Any]) -> str:
    def ms(metric: str) -> str:
        p = summary[metric]
        if p["p50"] is None:
            return f"{metric[:-3]:>11} -"
        return (
            f"{metric[:-3]:>11} p50/p90/p99/max {p['p50']:8.2f} {p['p90']:8.2f} {p['p99']:8.2f} "
            f"{p['max']:8.2f} ms"
        )

    per_response = summary["tokens_per_response"]
    return "\n".join(
        [
            f"[{label}] {summary['num_requests']} requests, {summary['num_errors']} errors, "
            f"{summary['elapsed_s']:.2f} s: {summary['output_tokens_per_s']:.1f} output tok/s, "
            f"{summary['requests_per_s']:.2f} req/s, "
            f"{per_response:.2f} tokens/response"
            if per_response is not None
            else f"[{label}] no responses",
            "  " + ms("ttft_ms"),
            "  " + ms("tpot_ms"),
            "  " + ms("itl_ms"),
            "  " + ms("longest_gap_ms"),
        ]
    )


def run_offline(engine: Any, jobs: list[Job], concurrency: int | None) -> list[RequestRecord]:
    """Drives an in-process LLMEngine like a client would: all jobs at once (`concurrency` None) or
    a closed loop of `concurrency` requests in flight; records arrivals as step outputs appear."""
    from paged_llm.sampling_params import SamplingParams

    pending = list(jobs)
    records: dict[str, RequestRecord] = {}

    def submit(job: Job) -> None:
        fields = {"temperature": 0.0, "max_tokens": job.num_output_tokens, "ignore_eos": True}
        if job.structured_outputs is not None:
            fields["structured_outputs"] = job.structured_outputs
        if job.lora_name is not None:
            fields["lora_name"] = job.lora_name
        params = SamplingParams.from_mapping(fields)
        request_id = f"offline-{job.index}"
        records[request_id] = RequestRecord(job.index, time.monotonic())
        engine.add_request(request_id, job.prompt_token_ids, params)

    limit = len(pending) if concurrency is None else concurrency
    while pending and engine.processor.num_unfinished_requests < limit:
        submit(pending.pop(0))
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.monotonic()
            record = records[output.request_id]
            num_tokens = sum(len(s.token_ids) for s in output.sequences)
            if num_tokens:
                record.arrival_times.append(now)
                record.tokens_per_response.append(num_tokens)
            if output.finished and output.error is not None:
                record.error = str(output.error)
            if output.finished and pending:
                submit(pending.pop(0))
    return [records[k] for k in sorted(records, key=lambda k: records[k].index)]
