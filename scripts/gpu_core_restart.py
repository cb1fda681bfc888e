"""kill -9 of the engine core under load on a GPU: how the server comes back, and what the card holds.

Starts tritonserver on a model repository (`server_process make-repository ...`), opens `--streams`
gRPC streams, kills the engine core process with SIGKILL while they run, then records:
  - how every in-flight request ended (each must get exactly one final: an error),
  - when the OpenAI-style readiness came back: the first 1-token request that succeeds again,
  - the card's compute processes before, right after and once serving again (the dead core's pid must
    be gone from nvidia-smi and its memory given back),
  - a second wave of `--streams` streams after the restart (all must succeed).

    python scripts/gpu_core_restart.py --repository REPO --out OUT_DIR [--streams 64]

Writes OUT_DIR/core_restart.json and prints a summary. Needs a CUDA host (scripts/gpu_host/bringup.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from paged_llm.launcher.procfs import descendants, read_proc
from paged_llm.testing.server_process import start_server


def compute_apps() -> dict[int, int]:
    """pid -> MiB the card's compute processes hold (nvidia-smi)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    apps = {}
    for line in out.splitlines():
        if line.strip():
            pid, mib = (part.strip() for part in line.split(","))
            apps[int(pid)] = int(mib)
    return apps


def core_pids(server_pid: int) -> list[int]:
    found = []
    for pid in descendants(server_pid):
        cmdline = read_proc(pid, "cmdline") or b""
        if b"paged_llm.engine.engine_core.process" in cmdline:
            found.append(pid)
    return found


def request_inputs(prompt_ids: list[int], max_tokens: int) -> list[grpcclient.InferInput]:
    ids = grpcclient.InferInput("input_ids", [len(prompt_ids)], "INT32")
    ids.set_data_from_numpy(np.array(prompt_ids, dtype=np.int32))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(
        np.array([json.dumps({"max_tokens": max_tokens, "ignore_eos": True}).encode()], dtype=np.object_)
    )
    return [ids, stream, params]


def run_streams(
    url: str, count: int, max_tokens: int, timeout_s: float, started: threading.Event | None = None
):
    """`count` requests on one gRPC stream; returns (successes, error messages, finals)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    successes, errors, finals, tokens = 0, [], 0, 0
    try:
        for index in range(count):
            client.async_stream_infer(
                "llm", request_inputs([1000 + index % 97] * 256, max_tokens), request_id=str(index),
                enable_empty_final_response=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while finals < count and time.monotonic() < deadline:
            try:
                result, error = events.get(timeout=1.0)
            except queue.Empty:
                continue
            if error is not None:
                errors.append(str(error))
                finals += 1
                continue
            response = result.get_response()
            if response.outputs:
                tokens += 1
                if started is not None and tokens >= count:
                    started.set()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                successes += 1
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return successes, errors, finals


def one_token_ok(url: str) -> bool:
    try:
        successes, errors, _ = run_streams(url, 1, 1, timeout_s=10.0)
    except Exception:
        return False
    return successes == 1 and not errors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument(
        "--max-tokens", type=int, default=1536, help="below max_model_len minus the 256-token prompt"
    )
    parser.add_argument("--come-back-s", type=float, default=60.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"streams": args.streams}
    server = start_server(args.repository, args.out / "core_restart_server.log", timeout_s=600)
    try:
        url = server.grpc_url
        assert one_token_ok(url), "the server does not serve before the kill"
        started = threading.Event()
        wave: dict = {}

        def first_wave() -> None:
            wave["result"] = run_streams(url, args.streams, args.max_tokens, 120.0, started)

        thread = threading.Thread(target=first_wave, daemon=True)
        thread.start()
        started.wait(timeout=120)
        time.sleep(1.0)  # every stream is decoding
        cores = core_pids(server.process.pid)
        report["core_pids_before"] = cores
        report["apps_before_mib"] = compute_apps()
        assert len(cores) == 1, cores
        killed_at = time.monotonic()
        os.kill(cores[0], signal.SIGKILL)
        thread.join(timeout=60)
        successes, errors, finals = wave.get("result", (0, ["no result"], 0))
        report["first_wave"] = {
            "finals": finals,
            "successes": successes,
            "errors": len(errors),
            "error_examples": sorted(set(errors))[:3],
            "ended_s": round(time.monotonic() - killed_at, 2),
        }
        report["apps_right_after_mib"] = compute_apps()
        served_again_s = None
        while time.monotonic() - killed_at < args.come_back_s:
            if one_token_ok(url):
                served_again_s = time.monotonic() - killed_at
                break
            time.sleep(0.5)
        report["served_again_s"] = None if served_again_s is None else round(served_again_s, 2)
        report["core_pids_after"] = core_pids(server.process.pid)
        apps_after = compute_apps()
        report["apps_after_mib"] = apps_after
        report["dead_core_gone_from_card"] = cores[0] not in apps_after
        second = run_streams(url, args.streams, 256, 120.0)
        report["second_wave"] = {"successes": second[0], "errors": len(second[1]), "finals": second[2]}
        report["server_alive"] = server.process.poll() is None
    finally:
        server.stop()
    (args.out / "core_restart.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
