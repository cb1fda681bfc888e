"""Soak test: perf_analyzer --streaming at a fixed concurrency against a real tritonserver, then a
report of failed requests, server memory growth and whether every KV block came back.

  scripts/soak.sh                       # 10 minutes at concurrency 16 on the built-in tiny model
  scripts/soak.sh --requests 64         # a fixed number of requests (what CI runs: no time window,
                                        # so a slow or busy machine only makes it take longer)

Failures are counted on the server side (paged_llm_final_responses_total by status code, Triton's
nv_inference_request_failure), so a request that errored or never got its final response shows up
even if perf_analyzer does not complain. Exit status 1 if any request failed, KV usage did not
return to 0, or RSS grew more than --max-rss-growth-mib.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from paged_llm.launcher.launch import perf_analyzer_env, perf_analyzer_path
from paged_llm.paths import repo_root
from paged_llm.testing.prometheus import value as metric
from paged_llm.testing.server_process import RunningServer, start_server

FAILURE_CODES = ("cancelled", "invalid_arg", "unavailable", "internal")


def server_rss_bytes(server: RunningServer) -> int:
    """tritonserver plus its Python stub processes (where the engine lives)."""
    process = psutil.Process(server.process.pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def failures(text: str) -> dict[str, float]:
    counts = {code: metric(text, "paged_llm_final_responses_total", code=code) for code in FAILURE_CODES}
    counts["triton_failure"] = metric(text, "nv_inference_request_failure", model="llm")
    return counts


def run_perf_analyzer(
    server: RunningServer,
    input_data: Path,
    concurrency: int,
    duration_s: float | None,
    num_requests: int | None,
) -> tuple[int, str]:
    """Time windows (`duration_s`, by hand) or exactly `num_requests` requests (CI: a busy machine
    cannot make a window come out empty)."""
    command = [
        str(perf_analyzer_path()),
        "-m", "llm", "-i", "grpc", "-u", server.grpc_url, "--streaming",
        "--input-data", str(input_data),
        "--concurrency-range", str(concurrency),
    ]  # fmt: skip
    if num_requests is not None:
        command += ["--request-count", str(num_requests)]
    else:
        window_ms = max(int((duration_s or 0) * 1000 / 3), 1000)
        command += [
            "--measurement-interval",
            str(window_ms),
            "--stability-percentage",
            "100",
            "--max-trials",
            "3",
        ]
    completed = subprocess.run(command, env=perf_analyzer_env(), capture_output=True, text=True, check=False)
    return completed.returncode, completed.stdout + completed.stderr


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    load.add_argument("--requests", type=int, default=None, help="send exactly this many requests instead")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--input-data", type=Path, default=repo_root() / "clients/perf_inputs/llm_streaming.json"
    )
    parser.add_argument("--model-repository", type=Path, default=repo_root() / "model_repository")
    parser.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="paged_llm_soak."))
    server = start_server(args.model_repository, workdir / "server.log")
    try:
        # Warm-up: first requests allocate caches; measure growth from after them.
        run_perf_analyzer(server, args.input_data, 2, None, 4)
        before_text = server.metrics()
        rss_before = server_rss_bytes(server)
        started = time.monotonic()
        returncode, output = run_perf_analyzer(
            server, args.input_data, args.concurrency, args.duration, args.requests
        )
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = server.metrics()
            if (
                metric(text, "paged_llm_kv_cache_usage_ratio") == 0
                and metric(text, "paged_llm_num_requests_running") == 0
            ):
                break
            time.sleep(0.2)
        after_text = server.metrics()
        rss_after = server_rss_bytes(server)
        failed = {k: failures(after_text)[k] - failures(before_text)[k] for k in failures(after_text)}
        succeeded = metric(after_text, "paged_llm_final_responses_total", code="success") - metric(
            before_text, "paged_llm_final_responses_total", code="success"
        )
        throughput = re.search(r"Throughput: ([\d.]+) infer/sec", output)
        # perf_analyzer exits 2 when its throughput windows never agree; the load was still applied
        # and the server-side counters below are what the soak judges.
        unstable = returncode != 0 and "Failed to obtain stable measurement" in output
        report = {
            "duration_s": round(elapsed, 1),
            "concurrency": args.concurrency,
            "perf_analyzer_exit_code": returncode,
            "perf_analyzer_unstable_only": unstable,
            "requests_succeeded": int(succeeded),
            "requests_failed": int(sum(failed.values())),
            "failures_by_code": {k: int(v) for k, v in failed.items()},
            "throughput_infer_per_s": float(throughput.group(1)) if throughput else None,
            "generation_tokens": int(
                metric(after_text, "paged_llm_generation_tokens_total")
                - metric(before_text, "paged_llm_generation_tokens_total")
            ),
            "rss_before_mib": round(rss_before / 2**20, 1),
            "rss_after_mib": round(rss_after / 2**20, 1),
            "rss_growth_mib": round((rss_after - rss_before) / 2**20, 1),
            "kv_cache_usage_after": metric(after_text, "paged_llm_kv_cache_usage_ratio"),
            "requests_running_after": metric(after_text, "paged_llm_num_requests_running"),
        }
    finally:
        server.stop()
    for key, value in report.items():
        print(f"{key:>26}: {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ok = (
        (returncode == 0 or report["perf_analyzer_unstable_only"])
        and report["requests_failed"] == 0
        and report["requests_succeeded"] > 0
        and report["kv_cache_usage_after"] == 0
        and report["rss_growth_mib"] <= args.max_rss_growth_mib
    )
    if not ok:
        print(f"SOAK FAILED (perf_analyzer output follows)\n{output[-4000:]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
