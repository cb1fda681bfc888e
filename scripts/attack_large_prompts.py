"""Latency of tiny requests while other clients loop huge text prompts (issue "Hardening", row 13).

  .venv/bin/python scripts/attack_large_prompts.py --launch model_repository   # or --url HOST:8001

`--attackers` threads each send prompts of `--prompt-bytes` (default just under the 1 MiB cap;
they are tokenized, then refused: far more tokens than max_model_len) in a loop, each on its own
gRPC stream; meanwhile one client sends `--num-tiny` tiny requests (1 token) one after the other
and records how long each took. Prints the tiny requests' latency p50 / p90 / max, without and
with the attack.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from paged_llm.testing.bench_workload import infer_inputs


def _inputs(prompt: str) -> list[grpcclient.InferInput]:
    arrays = [
        ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        (
            "sampling_parameters",
            np.array([json.dumps({"max_tokens": 1}).encode()], dtype=np.object_),
            "BYTES",
        ),
    ]
    return infer_inputs(grpcclient, arrays)


class _Stream:
    """One gRPC stream; `request()` sends and waits for that request's final (or error)."""

    def __init__(self, url: str) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def request(self, prompt: str, timeout_s: float = 300.0) -> bool:
        self.client.async_stream_infer("llm", _inputs(prompt), enable_empty_final_response=True)
        while True:
            result, error = self.events.get(timeout=timeout_s)
            if error is not None:
                return False
            if result.get_response().parameters["triton_final_response"].bool_param:
                return True

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def tiny_latencies_ms(url: str, count: int) -> list[float]:
    stream = _Stream(url)
    latencies = []
    try:
        for _ in range(count):
            started = time.monotonic()
            assert stream.request("hi"), "a tiny request failed"
            latencies.append(1e3 * (time.monotonic() - started))
    finally:
        stream.close()
    return latencies


def _attack(url: str, prompt: str, stop: threading.Event, counts: list[int]) -> None:
    stream = _Stream(url)
    try:
        while not stop.is_set():
            stream.request(prompt)  # refused after tokenization: too many tokens
            counts.append(1)
    finally:
        stream.close()


def _summary(label: str, latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    median = statistics.median(ordered)
    return f"{label}: tiny request latency p50 {median:.1f} ms, p90 {p90:.1f} ms, max {ordered[-1]:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="gRPC address of a running tritonserver")
    target.add_argument(
        "--launch", type=Path, help="start tritonserver on this model repository, stop it after"
    )
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--prompt-bytes", type=int, default=(1 << 20) - 1024)
    parser.add_argument("--num-tiny", type=int, default=20)
    args = parser.parse_args()
    server = None
    if args.launch:
        from paged_llm.testing.server_process import start_server

        log_path = Path(tempfile.mkdtemp(prefix="attack.")) / "server.log"
        print(f"starting tritonserver on {args.launch} (log: {log_path})", file=sys.stderr)
        server = start_server(args.launch.resolve(), log_path, timeout_s=600.0)
    url = server.grpc_url if server else args.url
    try:
        tiny_latencies_ms(url, 3)  # warm-up
        print(_summary("no attack", tiny_latencies_ms(url, args.num_tiny)), flush=True)
        prompt = ("many words " * (args.prompt_bytes // 11 + 1))[: args.prompt_bytes]
        stop, counts = threading.Event(), []
        attackers = [
            threading.Thread(target=_attack, args=(url, prompt, stop, counts), daemon=True)
            for _ in range(args.attackers)
        ]
        for thread in attackers:
            thread.start()
        time.sleep(2.0)  # the attack is under way
        latencies = tiny_latencies_ms(url, args.num_tiny)
        stop.set()
        print(
            _summary(f"{args.attackers} clients looping {len(prompt):,}-byte prompts", latencies)
            + f" ({len(counts)} huge prompts answered meanwhile)",
            flush=True,
        )
        for thread in attackers:
            thread.join(timeout=120)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
