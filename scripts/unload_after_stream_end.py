"""Does unloading `llm` complete after a client ended its gRPC stream this way? (README, "Known
limits": Triton 2.51 can keep a cancelled stream's request, and with it the model, for ever.)

  .venv/bin/python scripts/unload_after_stream_end.py --ending cancel --cycles 60

Each cycle: one request with max_tokens 4 on a fresh gRPC stream, read to its final response, the
stream ended as `--ending` says, then an unload of `llm` (explicit model control) and a wait of up
to `--unload-timeout-s` for it to complete, then a load. A stuck unload is counted and its server
replaced by a fresh one. Endings:

  cancel        tritonclient's stop_stream(cancel_requests=True), then close() (the channel)
  half-close    stop_stream() (the client closes its side; Triton ends the call), then close()
  aio-drop      tritonclient.grpc.aio: the call dropped after its final (gRPC cancels it when it is
                collected), then the client closed
  aio-drop-keep the same, but one aio client (channel) kept for the whole server
  aio-read      the aio call read to its end (Triton ends it), then the client closed
  http          no stream: one HTTP generate request
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paged_llm.launcher.repository import make_model_repository
from paged_llm.testing.server_process import RunningServer, start_server
from tests.e2e.client import http_post, make_inputs
from tests.e2e.metrics import wait_for

ENDINGS = ("cancel", "half-close", "aio-drop", "aio-drop-keep", "aio-read", "http")


def _is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def _sync_stream(server: RunningServer, cancel: bool) -> None:
    events: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    inputs = make_inputs("reload", sampling_parameters={"max_tokens": 4})
    client.async_stream_infer("llm", inputs, request_id="0", enable_empty_final_response=True)
    while True:
        result, error = events.get(timeout=60)
        if error is not None:
            raise RuntimeError(error)
        if _is_final(result):
            break
    client.stop_stream(cancel_requests=cancel)
    client.close()


class _AioStreams:
    def __init__(self, ending: str) -> None:
        self.ending = ending
        self.loop = asyncio.new_event_loop()
        self.kept: dict[str, aioclient.InferenceServerClient] = {}

    def run(self, server: RunningServer) -> None:
        self.loop.run_until_complete(self._one(server.grpc_url))

    async def _one(self, url: str) -> None:
        keep = self.ending == "aio-drop-keep"
        client = self.kept.setdefault(url, aioclient.InferenceServerClient(url)) if keep else None
        client = client or aioclient.InferenceServerClient(url)
        inputs = make_inputs("reload", sampling_parameters={"max_tokens": 4})

        async def requests():
            yield {"model_name": "llm", "inputs": inputs, "request_id": "0"} | {
                "enable_empty_final_response": True
            }

        responses = client.stream_infer(requests())
        async for result, error in responses:
            if error is not None:
                raise RuntimeError(error)
            if _is_final(result):
                break
        if self.ending == "aio-read":
            async for _ in responses:
                pass
        del responses
        gc.collect()
        if keep:
            await asyncio.sleep(0.05)
        else:
            await client.close()


def _processes_below(server: RunningServer) -> dict[str, Any]:
    """What runs below a server whose unload is stuck: its stubs (with RSS) and engine cores."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    stubs = [p for p in children if "stub" in p.name()]
    cores = [p for p in children if "paged_llm.engine.engine_core.process" in " ".join(p.cmdline())]
    return {"stubs_rss_mib": [p.memory_info().rss >> 20 for p in stubs], "engine_cores": len(cores)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ending", choices=ENDINGS, required=True)
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--unload-timeout-s", type=float, default=60.0)
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="unload_after_stream_end."))
    repository = make_model_repository(root / "models", models=("llm",))
    aio = _AioStreams(args.ending) if args.ending.startswith("aio") else None
    servers_started, stuck, unload_seconds = 0, [], []
    left_behind: list[dict[str, Any]] = []

    def fresh_server() -> RunningServer:
        nonlocal servers_started
        servers_started += 1
        log = root / f"server{servers_started}.log"
        return start_server(repository, log, ["--model-control-mode=explicit", "--load-model=llm"])

    def state(server: RunningServer) -> str | None:
        index = json.loads(http_post(server.http_url, "/v2/repository/index", {})[1])
        return next((m.get("state") for m in index if m["name"] == "llm"), None)

    server = fresh_server()
    try:
        for cycle in tqdm(range(args.cycles), desc=args.ending, unit="cycle"):
            if args.ending in ("cancel", "half-close"):
                _sync_stream(server, cancel=args.ending == "cancel")
            elif aio is not None:
                aio.run(server)
            else:
                status, body = http_post(
                    server.http_url, "/v2/models/llm/generate", {"text_input": "reload", "max_tokens": 4}
                )
                assert status == 200, body
            start = time.monotonic()
            assert http_post(server.http_url, "/v2/repository/models/llm/unload", {})[0] == 200
            unloaded = functools.partial(lambda s: state(s) == "UNAVAILABLE", server)
            if wait_for(unloaded, timeout_s=args.unload_timeout_s):
                unload_seconds.append(time.monotonic() - start)
                loaded = http_post(server.http_url, "/v2/repository/models/llm/load", {}, timeout_s=120)
                assert loaded[0] == 200, loaded
                continue
            stuck.append(cycle)
            left = _processes_below(server)
            tqdm.write(f"cycle {cycle}: the unload did not complete ({server.log_path}); running: {left}")
            left_behind.append(left)
            server.stop()
            server = fresh_server()
    finally:
        server.stop()
    summary = {
        "ending": args.ending,
        "cycles": args.cycles,
        "stuck_unloads": len(stuck),
        "stuck_at_cycles": stuck,
        "unload_s_max": round(max(unload_seconds), 2) if unload_seconds else None,
        "processes_of_stuck_unloads": left_behind,
        "logs": str(root),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
