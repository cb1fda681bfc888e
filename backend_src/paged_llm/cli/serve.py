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
from pathlib import Path

from paged_llm.cli.arguments import (
    build_parser,
    chat_flags,
    engine_parameters,
    instance_count,
    lora_flags,
)
from paged_llm.cli.children import (
    EXIT_TIMEOUT_S,
    Children,
    get_status,
    stop_all,
    supervise,
    wait_for_ports,
    wait_until,
)
from paged_llm.launcher.guard_process import (
    TRITON_LOOPBACK,
    GuardedPorts,
    guarded_ports,
    start_guard,
    stop_guard,
)
from paged_llm.launcher.launch import (
    ServerPorts,
    busy_ports,
    has_nvidia_gpu,
    http_host,
    port_bind_error,
    server_command,
    server_env,
)
from paged_llm.launcher.repository import TRTLLM_MODEL_NAMES, make_model_repository
from paged_llm.launcher.stub_watch import StubWatch
from paged_llm.launcher.supervise import RestartBudget
from paged_llm.models.tiny_model import TINY_MODEL_NAME
from paged_llm.openai.server import API_KEY_ENV, api_keys
from paged_llm.paths import paged_llm_home
from paged_llm.triton_model.auth import API_KEY_VERIFIER_ENV, make_verifier


def write_repository(args: argparse.Namespace) -> Path:
    root = (
        Path(args.model_repository_dir)
        if args.model_repository_dir
        else paged_llm_home() / "serve" / args.served_model_name
    )
    # Under the default name, the TensorRT-LLM convention's models (llm_trtllm, ensemble,
    # tensorrt_llm_bls: they forward to llm by that name) come along, as in the project's repository.
    models = ("llm", *TRTLLM_MODEL_NAMES) if args.served_model_name == "llm" else ("llm",)
    lora_flags(args)  # an adapter named like the model: refused before anything starts
    parameters = engine_parameters(args)
    count = instance_count(args, parameters, has_nvidia_gpu())
    make_model_repository(root, parameters, models=models, instance_count=count)
    if args.served_model_name != "llm":  # Triton names a model after its directory
        shutil.rmtree(root / args.served_model_name, ignore_errors=True)
        (root / "llm").rename(root / args.served_model_name)
    for stale in root.iterdir():  # an earlier run under another layout
        if stale.is_dir() and stale.name not in (args.served_model_name, *models):
            shutil.rmtree(stale, ignore_errors=True)
    return root


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
        children = Children(subprocess.Popen(command, env=triton_env), guard=guard)
    except BaseException:
        stop_guard(guard)
        raise
    try:  # whatever goes wrong here, the children go too (a GPU left held is the worst case)
        ready_url = f"{guard_ports.triton_http_url}/v2/models/{args.served_model_name}/ready"
        watch = StubWatch(children.server.pid, guard_ports.triton_http_url)
        if wait_until(
            lambda: get_status(ready_url) == 200, children.server, args.startup_timeout_s, stopping
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
            openai_command += chat_flags(args) + lora_flags(args)
            env = dict(os.environ)
            env[API_KEY_ENV] = ",".join(keys)  # in the environment, not on a command line `ps` shows
            children.openai_server = subprocess.Popen(openai_command, env=env)
            health_url = f"http://{host}:{args.port}/health"
            if wait_until(lambda: get_status(health_url) == 200, children.openai_server, 60.0, stopping):
                print(_banner(args, ports), file=sys.stderr, flush=True)
        triton_ports = [(args.address, ports.grpc)]
        triton_ports += [(TRITON_LOOPBACK, getattr(guard_ports.triton, name)) for name in guard_ports.guarded]

        def restart() -> subprocess.Popen:
            wait_for_ports(triton_ports)
            return subprocess.Popen(command, env=triton_env)

        budget = RestartBudget(args.max_restarts, args.restart_window_s)
        return supervise(children, watch, stopping, restart, budget)
    except BaseException:
        stop_all(children, signal.SIGTERM)
        raise


def _triton_http(ports: GuardedPorts) -> str:
    """Where the OpenAI server reaches Triton's HTTP endpoint: its loopback port, not the guard's
    (one hop less; the OpenAI server sends no form bodies)."""
    return ports.triton_http_url.removeprefix("http://")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
