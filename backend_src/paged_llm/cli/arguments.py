"""`paged-llm serve`'s flags, and what they become: the llm model's config.pbtxt parameters and the
OpenAI server's chat flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from paged_llm.config import ServingConfig
from paged_llm.launcher.guard_process import DEFAULT_MAX_BODY_BYTES
from paged_llm.models.tiny_model import TINY_MODEL_NAME
from paged_llm.openai.server import API_KEY_ENV, add_chat_arguments


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
    add(
        "--instance-count",
        type=int,
        help="Triton instances of the model, sharing one engine core; each stub turns its own requests' "
        f"tokens into responses (default: {GPU_INSTANCE_COUNT} where a GPU serves, 1 on a CPU)",
    )
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
    add(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT checkpoint directories) a request selects by model NAME (OpenAI) or "
        "lora_name NAME (Triton)",
    )
    add("--max-loras", type=int, help="adapters one step serves at once (default 8)")
    add("--max-lora-rank", type=int, help="the largest adapter rank (default 64)")
    add("--max-cpu-loras", type=int, help="adapters kept in host memory (default: every one)")
    add(
        "--allow-runtime-lora-updates",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) load and unload adapters "
        "while serving (behind --api-key when one is set)",
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


# One stub sends at most ~7-8k responses/s; at ~18k tok/s on an H100 two instances merged 1.6-1.8
# tokens per response and three 1.2-1.4 (docs/benchmarks/serving.md).
GPU_INSTANCE_COUNT = 3


def instance_count(args: argparse.Namespace, parameters: dict[str, str], has_gpu: bool) -> int:
    """--instance-count, else 3 where the engine will run on a GPU (device auto or cuda on a host
    with one), else 1: on a CPU the engine, not the stub, sets the pace. Only instances of a core in
    its own process share it: with engine_mode=thread each instance would load its own engine.
    `parameters`: the llm model's parameters these flags give (engine_parameters)."""
    if args.instance_count is not None:
        if args.instance_count < 1:
            raise SystemExit(f"error: --instance-count must be >= 1, got {args.instance_count}")
        return args.instance_count
    shares_one_core = parameters.get("engine_mode", ServingConfig.engine_mode) == "process"
    on_gpu = has_gpu and parameters.get("device", "auto").split(":", 1)[0] in ("auto", "cuda")
    return GPU_INSTANCE_COUNT if on_gpu and shares_one_core else 1


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
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
    )
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            parameters[flag] = str(value)
    if args.lora_modules:
        parameters["lora_modules"] = " ".join(_absolute_lora_modules(args.lora_modules))
    if args.allow_runtime_lora_updates:
        parameters["allow_runtime_lora_updates"] = "true"
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --engine-arg {item!r}: expected key=value")
        parameters[key] = value
    return parameters


def _absolute_lora_modules(items: list[str]) -> list[str]:
    """NAME=PATH items with PATH absolute (the stub does not run in this directory)."""
    resolved = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --lora-modules {item!r}: expected NAME=PATH")
        resolved.append(f"{name}={Path(path).expanduser().resolve()}")
    return resolved


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The OpenAI server's flags routing each adapter's name (--lora-modules, or lora_modules given
    with --engine-arg) to the served model."""
    modules = engine_parameters(args).get("lora_modules", "")
    flags = []
    for item in modules.replace(",", " ").split():
        name = item.partition("=")[0]
        if name == args.served_model_name:
            raise SystemExit(f"error: LoRA adapter {name!r} has the served model's name")
        flags += ["--lora-adapter", f"{name}={args.served_model_name}"]
    if args.allow_runtime_lora_updates:
        flags.append("--allow-runtime-lora-updates")
    return flags


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
