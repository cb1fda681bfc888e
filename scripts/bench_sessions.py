"""Multi-turn conversations: a session (each turn sends only its new tokens; the server keeps the KV)
against stateless requests that re-send the whole history every turn, through tritonserver and in
the offline engine, in one run. Prints TTFT per turn and writes a JSON and a PNG of TTFT vs turn.

  python scripts/bench_sessions.py --launch REPO --turns 20 --turn-tokens 200 --output-tokens 32 \\
      --json out.json --plot out.png

Through the server (gRPC streaming, one conversation at a time, turns of the session and stateless
conversations alternating): `session`, and `stateless` (prefix caching on, as the server runs it).
Offline (LLMEngine on the same config.pbtxt settings, after the server stopped): `session`,
`stateless` and `stateless, no prefix cache` (every turn computes the whole history).
Greedy decoding with ignore_eos, so every turn has exactly --output-tokens.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np


def _inputs(token_ids: list[int], max_tokens: int, session: dict[str, Any] | None) -> list[Any]:
    import tritonclient.grpc as grpcclient

    from paged_llm.testing.bench_workload import infer_inputs

    params = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    tensors = [
        ("input_ids", np.array(token_ids, dtype=np.int32), "INT32"),
        ("stream", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([params], dtype=np.object_), "BYTES"),
    ]
    if session is not None:
        tensors += [
            ("session_id", np.array([session["id"].encode()], dtype=np.object_), "BYTES"),
            ("session_start", np.array([session["start"]]), "BOOL"),
            ("session_end", np.array([session["end"]]), "BOOL"),
        ]
    return infer_inputs(grpcclient, tensors)


class ServedConversation:
    """One conversation over one gRPC stream; `turn()` returns (TTFT s, output ids)."""

    def __init__(self, url: str, use_session: bool, name: str) -> None:
        import tritonclient.grpc as grpcclient

        self.events: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        self.use_session = use_session
        self.name = name
        self.history: list[int] = []
        self.turns = 0

    def turn(self, new: list[int], max_tokens: int, last: bool) -> tuple[float, list[int]]:
        session = None
        prompt = self.history + new
        if self.use_session:
            session = {"id": self.name, "start": self.turns == 0, "end": last}
            prompt = new
        start = time.perf_counter()
        self.client.async_stream_infer(
            "llm", _inputs(prompt, max_tokens, session), enable_empty_final_response=True
        )
        ttft = None
        output: list[int] = []
        while True:
            result, error = self.events.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"{self.name}: {error}")
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                if ttft is None:
                    ttft = time.perf_counter() - start
                output.extend(int(t) for t in ids.reshape(-1))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        self.history += new + output
        self.turns += 1
        assert ttft is not None
        return ttft, output

    def close(self) -> None:
        self.client.stop_stream()  # half-close: every request on it has ended
        self.client.close()


def offline_conversation(engine: Any, turns: list[list[int]], max_tokens: int, use_session: bool, name: str):
    from paged_llm.core.sessions import SessionTurn
    from paged_llm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    history: list[int] = []
    ttfts, outputs = [], []
    for index, new in enumerate(turns):
        session = SessionTurn(name, start=index == 0, end=index == len(turns) - 1) if use_session else None
        start = time.perf_counter()
        engine.add_request(f"{name}-{index}", new if use_session else history + new, params, session=session)
        ttft, output = None, []
        while engine.has_unfinished_requests():
            for result in engine.step():
                for delta in result.sequences:
                    if delta.token_ids and ttft is None:
                        ttft = time.perf_counter() - start
                    output.extend(delta.token_ids)
        history += new + output
        ttfts.append(ttft)
        outputs.append(output)
    return ttfts, outputs


def _plot(results: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, ttfts in results.items():
        ax.plot(range(1, len(ttfts) + 1), [t * 1e3 for t in ttfts], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launch", type=Path, required=True, help="model repository to serve")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="conversations per mode (median per turn)")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--offline-only", action="store_true", help="skip the served conversations")
    parser.add_argument(
        "--offline-kv-bytes", type=int, default=8 << 30, help="each offline engine's KV pool (bytes)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--server-log", type=Path)
    args = parser.parse_args()

    from bench_serving import read_llm_parameters  # scripts/ is on sys.path
    from tqdm import tqdm

    from paged_llm.config import EngineConfig
    from paged_llm.engine.llm_engine import LLMEngine
    from paged_llm.models.builtin import resolve_model_dir

    rng = random.Random(0)

    def conversation() -> list[list[int]]:
        return [[rng.randrange(100, 20000) for _ in range(args.turn_tokens)] for _ in range(args.turns)]

    # Each mode its own tokens: a stateless turn must not hit the blocks a session just computed.
    conversations = {mode: [conversation() for _ in range(args.repeats)] for mode in ("session", "stateless")}
    served = {} if args.offline_only else run_served(args, conversations, conversation()[0])
    if served:
        _report(served, args)
    offline: dict[str, list[list[float]]] = {}
    if not args.no_offline:
        _wait_for_device_memory()  # the server's engine core may still be exiting
        # An explicit pool: sizing by free memory would count what the server has not released yet.
        config_cache = {"memory_bytes": args.offline_kv_bytes}
        config = EngineConfig.from_parameters(read_llm_parameters(args.launch))
        model = str(resolve_model_dir(config.model.model, args.launch / "llm"))
        config = replace(config, model=replace(config.model, model=model))
        for label, caching in (("offline session", True), ("offline stateless", True),
                               ("offline stateless, no prefix cache", False)):  # fmt: skip
            engine = LLMEngine(
                replace(config, cache=replace(config.cache, enable_prefix_caching=caching, **config_cache)),
                show_progress=False,
            )
            mode = "stateless" if "stateless" in label else "session"
            try:
                offline_conversation(engine, [conversation()[0]], args.output_tokens, False, "warm-up")
                offline[label] = [
                    offline_conversation(engine, turns, args.output_tokens, mode == "session", f"o{r}")[0]
                    for r, turns in enumerate(tqdm(conversations[mode], desc=label))
                ]
            finally:
                engine.shutdown()

    _report({**served, **offline}, args)
    return 0


def run_served(
    args: argparse.Namespace, conversations: dict[str, list[list[list[int]]]], warm_up_turn: list[int]
) -> dict[str, list[list[float]]]:
    """TTFT per turn of each served conversation, session and stateless turns alternating."""
    from tqdm import tqdm

    from paged_llm.testing.server_process import start_server

    served: dict[str, list[list[float]]] = {"served session": [], "served stateless": []}
    log_path = args.server_log or Path("/tmp/bench_sessions_server.log")
    server = start_server(args.launch.resolve(), log_path, timeout_s=1800.0)
    try:
        warm_up = ServedConversation(server.grpc_url, False, "warm-up")
        warm_up.turn(warm_up_turn, args.output_tokens, True)
        warm_up.close()
        for repeat in tqdm(range(args.repeats), desc="served conversations"):
            session = ServedConversation(server.grpc_url, True, f"bench-{repeat}")
            stateless = ServedConversation(server.grpc_url, False, f"stateless-{repeat}")
            ttfts: dict[str, list[float]] = {"served session": [], "served stateless": []}
            for index in range(args.turns):  # alternating: both see the same server state over time
                last = index == args.turns - 1
                ttfts["served session"].append(
                    session.turn(conversations["session"][repeat][index], args.output_tokens, last)[0]
                )
                ttfts["served stateless"].append(
                    stateless.turn(conversations["stateless"][repeat][index], args.output_tokens, last)[0]
                )
            session.close()
            stateless.close()
            for label, values in ttfts.items():
                served[label].append(values)
    finally:
        server.stop()
    return served


def _wait_for_device_memory(timeout_s: float = 120.0) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.9 * total:
            return
        time.sleep(1.0)


def _report(runs_by_label: dict[str, list[list[float]]], args: argparse.Namespace) -> None:
    medians = {
        label: [statistics.median(run[i] for run in runs) for i in range(args.turns)]
        for label, runs in runs_by_label.items()
    }
    print(
        f"TTFT per turn (median of {args.repeats} conversations), ms; {args.turn_tokens} new tokens per turn"
    )
    print("turn  " + "  ".join(f"{label:>22}" for label in medians))
    for i in range(args.turns):
        print(f"{i + 1:>4}  " + "  ".join(f"{medians[label][i] * 1e3:>22.1f}" for label in medians))
    if args.json:
        summary = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs_by_label}
        args.json.write_text(json.dumps({**summary, "median_ttft_s": medians}, indent=1))
    if args.plot:
        _plot(medians, args.plot, f"TTFT per turn, {args.turn_tokens} new tokens a turn")


if __name__ == "__main__":
    sys.exit(main())
