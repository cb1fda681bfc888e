"""`paged-llm serve MODEL`: tritonserver with the llm model on MODEL, and the OpenAI server in front.

  paged-llm serve tiny-qwen3                        # the built-in tiny model (what `make serve` runs)
  paged-llm serve ~/models/Qwen3-0.6B --device cuda --port 9000 --api-key "$KEY"

Steps: write a model repository for the checkpoint under $PAGED_LLM_HOME/serve/<name>, start
tritonserver on it (every port on --address, loopback by default), wait until the model is ready,
start the OpenAI server (python -m paged_llm.openai) on --port, wait until its /health is ready,
print the URLs and a curl line. Ctrl-C (or SIGTERM) stops both and waits for them; tritonserver is
killed if it has not exited within its exit timeout (supervise.py says why).

Triton's HTTP and metrics ports are served by the HTTP guard (launcher/http_guard.py); tritonserver
binds them on loopback. A tritonserver that crashes, or whose Python stub dies, is replaced by a
fresh one on the same ports (the log says so; the OpenAI server keeps running, answering 503 until
Triton serves again), at most --max-restarts times within --restart-window-s: one death more stops
everything with a non-zero status (3 for a dead stub, 128 + signal for a crash) for a supervisor.
The OpenAI server or the guard exiting stops everything too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from paged_llm.launcher.guard_process import (
    DEFAULT_MAX_BODY_BYTES,
    TRITON_LOOPBACK,
    GuardedPorts,
    guarded_ports,
    start_guard,
    stop_guard,
)
from paged_llm.launcher.launch import (
    ServerPorts,
    busy_ports,
    http_host,
    port_bind_error,
    server_command,
    server_env,
)
from paged_llm.launcher.procfs import descendants
from paged_llm.launcher.repository import TRTLLM_MODEL_NAMES, make_model_repository
from paged_llm.launcher.shm_regions import remove_unused_regions, stub_regions
from paged_llm.launcher.stub_watch import StubWatch
from paged_llm.launcher.supervise import (
    DEAD_STUB_EXIT_STATUS,
    KILL_MARGIN_S,
    RestartBudget,
    describe_server_exit,
    exit_status,
)
from paged_llm.models.tiny_model import TINY_MODEL_NAME
from paged_llm.openai.server import API_KEY_ENV, add_chat_arguments, api_keys
from paged_llm.paths import paged_llm_home
from paged_llm.triton_model.auth import API_KEY_VERIFIER_ENV, make_verifier

EXIT_TIMEOUT_S = 5
_POLL_S = 0.25


@dataclass
class _Children:
    server: subprocess.Popen
    openai_server: subprocess.Popen | None = None
    guard: subprocess.Popen | None = None  # the HTTP guard on the public HTTP and metrics ports
    regions: set[str] = field(default_factory=set)  # the stubs' shared memory, removed after exit


def engine_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The llm model's config.pbtxt parameters for these flags (strings, as Triton keeps them)."""
    parameters = {"model": args.model_path, "device": args.device, "dtype": args.dtype}
    flags = (
        "max_model_len",
        "max_num_seqs",
        "gpu_memory_utilization",
        "max_num_batched_tokens",
        "num_speculative_tokens",
        "tensor_parallel_size",
        "load_format",
        "quantization",
        "kv_cache_dtype",
    )
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            parameters[flag] = str(value)
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --engine-arg {item!r}: expected key=value")
        parameters[key] = value
    return parameters


def write_repository(args: argparse.Namespace) -> Path:
    root = (
        Path(args.model_repository_dir)
        if args.model_repository_dir
        else paged_llm_home() / "serve" / args.served_model_name
    )
    # Under the default name, the TensorRT-LLM convention's models (llm_trtllm, ensemble,
    # tensorrt_llm_bls: they forward to llm by that name) come along, as in the project's repository.
    models = ("llm", *TRTLLM_MODEL_NAMES) if args.served_model_name == "llm" else ("llm",)
    make_model_repository(root, engine_parameters(args), models=models)
    if args.served_model_name != "llm":  # Triton names a model after its directory
        shutil.rmtree(root / args.served_model_name, ignore_errors=True)
        (root / "llm").rename(root / args.served_model_name)
    for stale in root.iterdir():  # an earlier run under another layout
        if stale.is_dir() and stale.name not in (args.served_model_name, *models):
            shutil.rmtree(stale, ignore_errors=True)
    return root


def _get_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception:  # not listening yet, a reset, a malformed answer: not ready
        return None


def _stop(children: _Children, signum: int) -> None:
    for process in (children.openai_server, children.server):
        if process is not None and process.poll() is None:
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass


def _wait_until(check, process: subprocess.Popen, timeout_s: float, stopping: list[int]) -> bool:
    """Polls `check()` until it holds; False if `process` exited, a stop signal came, or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping and process.poll() is None:
        if check():
            return True
        time.sleep(_POLL_S)
    return False


def _banner(args: argparse.Namespace, ports: ServerPorts) -> str:
    host = http_host(args.address)
    name = args.served_model_name
    key_header = ' -H "Authorization: Bearer $PAGED_LLM_API_KEY"' if args.has_keys else ""
    body = f'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'
    return (
        f"paged-llm is serving {args.model} as model '{name}':\n"
        f"  OpenAI API  http://{host}:{args.port}/v1  (/v1/models, /v1/completions, /v1/chat/completions)\n"
        f"  Triton      HTTP {host}:{ports.http}, gRPC {host}:{ports.grpc}, "
        f"metrics http://{host}:{ports.metrics}/metrics\n"
        "Try:\n"
        f"  curl -s http://{host}:{args.port}/v1/chat/completions{key_header} "
        f"-H 'Content-Type: application/json' -d '{body}'\n"
        "Ctrl-C stops both servers."
    )


def serve(args: argparse.Namespace) -> int:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.served_model_name):
        print(
            f"error: --served-model-name {args.served_model_name!r}: letters, digits, _ . - only",
            file=sys.stderr,
        )
        return 2
    if args.model == TINY_MODEL_NAME:
        args.model_path = TINY_MODEL_NAME
        tokenizer_dir = None
    else:
        path = Path(args.model).expanduser().resolve()
        if not (path / "config.json").is_file():
            print(f"error: {args.model}: not a checkpoint directory (no config.json)", file=sys.stderr)
            return 2
        args.model_path = str(path)
        tokenizer_dir = path
    ports = ServerPorts(args.http_port, args.grpc_port, args.metrics_port)
    busy = busy_ports(args.address, ports)
    openai_error = port_bind_error(args.address, args.port)
    if openai_error is not None:
        busy.append(f"OpenAI port {args.port} on {args.address} ({openai_error})")
    if busy:
        print(
            f"error: cannot serve: {'; '.join(busy)} busy. Pick other ports (--port, --http-port, ...).",
            file=sys.stderr,
        )
        return 2
    keys = list(api_keys(args.api_key))
    args.has_keys = bool(keys)
    extra_server_args: list[str] = []
    # The keys reach the OpenAI server alone; the llm model gets a salted verifier (triton_model/auth.py).
    triton_env = server_env()
    triton_env.pop(API_KEY_ENV, None)
    if keys:  # the same keys guard inference on Triton's ports
        triton_env[API_KEY_VERIFIER_ENV] = make_verifier(keys)  # a fresh salt at each launch
        extra_server_args = [
            "--grpc-header-forward-pattern=authorization",
            "--http-header-forward-pattern=[Aa]uthorization",
        ]
    repository = write_repository(args)
    guard_ports = guarded_ports(ports)
    try:
        guard = start_guard(args.address, guard_ports, args.http_max_body_bytes)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stopping: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    host = http_host(args.address)
    print(
        f"Starting tritonserver on {args.address} (model repository {repository})",
        file=sys.stderr,
        flush=True,
    )
    command = server_command(
        repository,
        guard_ports.triton,
        args.address,
        EXIT_TIMEOUT_S,
        extra_server_args,
        guarded=guard_ports.guarded,
    )
    try:
        children = _Children(subprocess.Popen(command, env=triton_env), guard=guard)
    except BaseException:
        stop_guard(guard)
        raise
    try:  # whatever goes wrong here, the children go too (a GPU left held is the worst case)
        ready_url = f"{guard_ports.triton_http_url}/v2/models/{args.served_model_name}/ready"
        watch = StubWatch(children.server.pid, guard_ports.triton_http_url)
        if _wait_until(
            lambda: _get_status(ready_url) == 200, children.server, args.startup_timeout_s, stopping
        ):
            watch.check()  # the stubs are known before anyone is told the server is up
            watch.server_up = True
            openai_command = [
                sys.executable, "-m", "paged_llm.openai",
                "--triton-url", f"{host}:{ports.grpc}", "--host", args.address, "--port", str(args.port),
                *(["--triton-http-url", _triton_http(guard_ports)] if args.openai_transport == "http"
                  else []),
                "--health-model", args.served_model_name, "--log-level", args.log_level,
                "--workers", str(args.openai_workers), "--generation-config", args.generation_config,
            ]  # fmt: skip
            if tokenizer_dir is not None:
                openai_command += ["--tokenizer", f"{args.served_model_name}={tokenizer_dir}"]
            openai_command += chat_flags(args)
            env = dict(os.environ)
            env[API_KEY_ENV] = ",".join(keys)  # in the environment, not on a command line `ps` shows
            children.openai_server = subprocess.Popen(openai_command, env=env)
            health_url = f"http://{host}:{args.port}/health"
            if _wait_until(lambda: _get_status(health_url) == 200, children.openai_server, 60.0, stopping):
                print(_banner(args, ports), file=sys.stderr, flush=True)
        triton_ports = [(args.address, ports.grpc)]
        triton_ports += [(TRITON_LOOPBACK, getattr(guard_ports.triton, name)) for name in guard_ports.guarded]

        def restart() -> subprocess.Popen:
            _wait_for_ports(triton_ports)
            return subprocess.Popen(command, env=triton_env)

        budget = RestartBudget(args.max_restarts, args.restart_window_s)
        return _supervise(children, watch, stopping, restart, budget)
    except BaseException:
        _stop_all(children, signal.SIGTERM)
        raise


def chat_flags(args: argparse.Namespace) -> list[str]:
    """The OpenAI server's chat flags (tool calling, reasoning, chat template) as given to serve."""
    flags = []
    if args.chat_template is not None:
        template = Path(args.chat_template).expanduser()  # (the OpenAI server may not share the cwd)
        flags += ["--chat-template", str(template.resolve()) if template.is_file() else args.chat_template]
    if args.tool_call_parser:
        flags += ["--tool-call-parser", args.tool_call_parser]
    if args.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    if args.reasoning_parser:
        flags += ["--reasoning-parser", args.reasoning_parser]
    return flags


def _triton_http(ports: GuardedPorts) -> str:
    """Where the OpenAI server reaches Triton's HTTP endpoint: its loopback port, not the guard's
    (one hop less; the OpenAI server sends no form bodies)."""
    return ports.triton_http_url.removeprefix("http://")


def _stop_all(children: _Children, signum: int) -> None:
    """Signals both children and waits for them; kills what is still there after tritonserver's
    exit timeout (and whatever it started)."""
    _stop(children, signum)
    children.regions.update(stub_regions(children.server.pid))
    kill_at = time.monotonic() + EXIT_TIMEOUT_S + KILL_MARGIN_S
    for process in (children.openai_server, children.server):
        if process is None:
            continue
        try:
            process.wait(timeout=max(0.1, kill_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"paged-llm: pid {process.pid} did not exit in time: killing it", file=sys.stderr)
            for pid in [process.pid, *descendants(process.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
    stop_guard(children.guard)
    remove_unused_regions(children.regions)


def _supervise(
    children: _Children,
    watch: StubWatch,
    stopping: list[int],
    restart: Callable[[], subprocess.Popen],
    budget: RestartBudget,
) -> int:
    """Runs until a stop signal or until a child exits; then stops both and returns the status.
    A tritonserver that exits on its own, or one with a dead stub (Triton 2.51 never restarts a
    stub), is replaced by a fresh one on the same ports while `budget` allows; the OpenAI server
    keeps running meanwhile (its /health answers 503 until Triton serves again)."""
    next_check = time.monotonic()
    failure = 0
    while not stopping:
        death: tuple[str, int] | None = None  # (what happened, the exit status it would give)
        if children.server.poll() is not None:
            returncode = children.server.returncode
            death = (describe_server_exit(returncode), exit_status(returncode) or 1)
        elif children.openai_server is not None and children.openai_server.poll() is not None:
            failure = 1
            returncode = children.openai_server.returncode
            print(f"paged-llm: the OpenAI server exited ({returncode})", file=sys.stderr)
            break
        elif children.guard is not None and children.guard.poll() is not None:
            failure = 1
            print(f"paged-llm: the HTTP guard exited ({children.guard.returncode})", file=sys.stderr)
            break
        elif children.openai_server is None:  # startup failed or timed out
            failure = 1
            print("paged-llm: the model did not become ready; stopping", file=sys.stderr)
            break
        elif time.monotonic() >= next_check:
            next_check = time.monotonic() + 1.0
            children.regions.update(stub_regions(children.server.pid))
            dead = watch.check()
            if dead:
                death = ("; ".join(dead), DEAD_STUB_EXIT_STATUS)
                try:  # a killed tritonserver's stubs leave its process tree before it is reaped
                    returncode = children.server.wait(timeout=1.0)
                    death = (describe_server_exit(returncode), exit_status(returncode) or 1)
                except subprocess.TimeoutExpired:
                    pass
        if death is not None:
            message, status = death
            if not budget.take():
                print(
                    f"paged-llm: {message}; {budget.limit} restarts within {budget.window_s:.0f} s already: "
                    "stopping",
                    file=sys.stderr,
                    flush=True,
                )
                failure = status
                break
            print(
                f"paged-llm: {message}: restarting tritonserver ({budget.describe()})",
                file=sys.stderr,
                flush=True,
            )
            _stop_server(children)
            if stopping:
                break
            children.server = restart()
            watch = StubWatch(children.server.pid, watch.http_url)
            continue
        time.sleep(_POLL_S)
    _stop_all(children, stopping[0] if stopping else signal.SIGTERM)
    return failure


def _stop_server(children: _Children) -> None:
    """Stops tritonserver alone (SIGTERM, then SIGKILL for it and what it started after its exit
    timeout) and removes its stubs' shared memory once unused."""
    server = children.server
    children.regions.update(stub_regions(server.pid))
    stragglers = descendants(server.pid)
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=EXIT_TIMEOUT_S + KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            print(
                f"paged-llm: tritonserver (pid {server.pid}) did not exit in time: killing it",
                file=sys.stderr,
            )
            stragglers = [server.pid, *descendants(server.pid)]
    for pid in stragglers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.wait()
    remove_unused_regions(children.regions)
    children.regions.clear()


def _wait_for_ports(ports: list[tuple[str, int]], timeout_s: float = 60.0) -> None:
    """Until each (address, port) can be bound: the old server's listeners are gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(port_bind_error(address, port) is None for address, port in ports):
            return
        time.sleep(_POLL_S)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-llm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="serve a checkpoint: tritonserver + the OpenAI API")
    add = serve_parser.add_argument
    add("model", nargs="?", default=TINY_MODEL_NAME, help=f"checkpoint directory, or {TINY_MODEL_NAME}")
    add("--served-model-name", default="llm", help="the model's name in both APIs")
    add("--address", default="127.0.0.1", help="address every server binds (default: loopback only)")
    add("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)), help="OpenAI API port")
    add("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    add("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    add("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    add("--api-key", action="append", default=[], help=f"repeatable; also ${API_KEY_ENV} (comma-separated)")
    add("--device", default="auto", help="auto | cpu | cuda | npu")
    add("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    add("--max-model-len", type=int)
    add("--max-num-seqs", type=int)
    add("--max-num-batched-tokens", type=int)
    add("--gpu-memory-utilization", type=float)
    add("--num-speculative-tokens", type=int, help="speculative decoding with n-gram proposals (0: off)")
    add("--tensor-parallel-size", type=int, help="GPUs one engine splits the model over (from --device)")
    add("--load-format", choices=["safetensors", "dummy"], help="dummy: random weights (benchmarks)")
    add(
        "--quantization",
        choices=["fp8"],
        help="fp8: quantize an unquantized checkpoint's projections at load (FP8 checkpoints need no flag)",
    )
    add(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="fp8: an e4m3 KV cache (twice the tokens)",
    )
    add("--engine-arg", action="append", default=[], help="key=value: any llm config.pbtxt parameter")
    add(
        "--model-repository-dir",
        help="where to write the model repository (default: $PAGED_LLM_HOME/serve/NAME)",
    )
    add("--startup-timeout-s", type=float, default=900.0)
    add(
        "--max-restarts",
        type=int,
        default=3,
        help="tritonserver restarts (after it crashed or a stub died) allowed within --restart-window-s; "
        "one more and paged-llm exits non-zero",
    )
    add("--restart-window-s", type=float, default=600.0)
    add(
        "--http-max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="the guard on Triton's HTTP and metrics ports answers 413 to a request body over this",
    )
    add("--log-level", default="warning", help="the OpenAI server's log level")
    add(
        "--openai-workers",
        type=int,
        default=max(1, min(6, (os.cpu_count() or 1) // 2)),
        help="OpenAI server processes (default: half the cores, at most 6: on a 16-core H100 host, 6 kept "
        "the OpenAI path's ITL p50 within 8%% of direct gRPC at 64 streams, 4 did not)",
    )
    add(
        "--generation-config",
        choices=["auto", "vllm"],
        default="auto",
        help="the OpenAI server's defaults for sampling parameters a request leaves unset: the "
        "checkpoint's generation_config.json (auto, as vLLM) or the engine's (vllm)",
    )
    add_chat_arguments(serve_parser)
    add(
        "--openai-transport",
        choices=["http", "grpc"],
        default="http",
        help="how the OpenAI server sends generation requests to Triton: its HTTP generate_stream "
        "(default; about half the CPU per streamed token of gRPC in the OpenAI server) or gRPC streaming",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
