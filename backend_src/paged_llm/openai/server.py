"""`python -m paged_llm.openai`: the OpenAI-compatible server in front of a running tritonserver.

python -m paged_llm.openai --triton-url 127.0.0.1:8001 --triton-http-url 127.0.0.1:8000 --port 9000 \\
    --tokenizer llm=/ckpt/Qwen3-0.6B
PAGED_LLM_API_KEY=secret python -m paged_llm.openai ...   (or --api-key, repeatable)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from paged_llm.launcher.launch import port_bind_error
from paged_llm.openai.app import create_app
from paged_llm.openai.reasoning import REASONING_PARSERS
from paged_llm.openai.settings import OpenAISettings
from paged_llm.openai.tool_parsers import TOOL_CALL_PARSERS
from paged_llm.openai.workers import LOG_FORMAT, run_workers

API_KEY_ENV = "PAGED_LLM_API_KEY"
_SETTINGS_ENV = "PAGED_LLM_OPENAI_SETTINGS"


def parse_tokenizers(values: list[str]) -> tuple[dict[str, Path], Path | None]:
    """`--tokenizer DIR` (every model) and `--tokenizer MODEL=DIR`."""
    per_model: dict[str, Path] = {}
    default = None
    for value in values:
        name, sep, directory = value.partition("=")
        if sep:
            per_model[name] = Path(directory).expanduser().resolve()
        else:
            default = Path(value).expanduser().resolve()
    return per_model, default


def api_keys(values: list[str], environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """--api-key values and $PAGED_LLM_API_KEY (comma-separated). SystemExit for an empty key (an
    unset shell variable: it would switch authentication off) or one with a comma or whitespace."""
    environ = os.environ if environ is None else environ
    keys = list(values) + [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    for key in keys:
        if not key or "," in key or any(c.isspace() for c in key):
            raise SystemExit(
                "error: an API key must be non-empty, without commas or whitespace "
                f"(got {len(key)} characters; is a shell variable unset?)"
            )
    return tuple(keys)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paged_llm.openai", description=__doc__.split("\n")[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint (host:port)")
    parser.add_argument(
        "--triton-http-url",
        help="Triton's HTTP endpoint (host:port): generation requests then go over its generate_stream, "
        "which costs this server about half the CPU per streamed token of gRPC (default: gRPC)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"a key clients must send as 'Authorization: Bearer KEY' (repeatable; also ${API_KEY_ENV}, "
        "comma-separated)",
    )
    parser.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        help="[MODEL=]DIR: checkpoint directory whose chat template and tokenizer serve MODEL (default: "
        "the llm model's own `model` parameter, when it is absolute or the built-in tiny model)",
    )
    parser.add_argument("--health-model", default="llm", help="/health is ready when this model is")
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger request bodies get 413")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes on the port, each with its own SO_REUSEPORT socket so that connections "
        "spread evenly (one Python process streams about 8k SSE events/s; /metrics sums them all)",
    )
    parser.add_argument(
        "--generation-config",
        choices=["auto", "vllm"],
        default="auto",
        help="auto: sampling parameters a request leaves unset take the checkpoint's "
        "generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty), as "
        "vLLM's OpenAI server does by default; vllm: the engine's defaults",
    )
    add_chat_arguments(parser)
    parser.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        help="ADAPTER=MODEL, repeatable: a request for model ADAPTER goes to Triton model MODEL with "
        "lora_name ADAPTER (the model loads the adapter: its lora_modules parameter)",
    )
    parser.add_argument(
        "--allow-runtime-lora-updates",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) go to --health-model, "
        "whose allow_runtime_lora_updates parameter must be on",
    )
    parser.add_argument("--log-level", default="warning")
    return parser


def parse_lora_adapters(values: list[str]) -> dict[str, str]:
    """--lora-adapter ADAPTER=MODEL values; SystemExit for a malformed one."""
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, model = value.partition("=")
        if not sep or not name or not model:
            raise SystemExit(f"error: --lora-adapter {value!r}: expected ADAPTER=MODEL")
        adapters[name] = model
    return adapters


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The chat flags vLLM's server has, here and on `paged-llm serve`."""
    parser.add_argument(
        "--chat-template",
        help="a Jinja chat template file (or the template itself) used instead of the checkpoint's",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help="how tool calls are read from the model's output: hermes (Qwen2.5, Qwen3) or llama3_json "
        "(Llama 3.1/3.2); also the format tool_choice required / a named function is held to",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the default with tools): the model decides, the parser reads its '
        "calls (needs --tool-call-parser)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split the <think>...</think> block of a reasoning model into message.reasoning_content",
    )


def chat_template_text(value: str | None) -> str | None:
    """--chat-template's template: the file's text, or the value itself when it is no file."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:  # neither a file nor a template: a mistyped path
        raise SystemExit(f"error: --chat-template {value}: no such file")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    per_model, default = parse_tokenizers(args.tokenizer)
    for directory in [*per_model.values(), *([default] if default else [])]:
        if not (directory / "tokenizer_config.json").is_file():
            print(f"error: --tokenizer {directory}: no tokenizer_config.json there", file=sys.stderr)
            return 2
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    metrics_dir = Path(tempfile.mkdtemp(prefix="paged_llm_openai_metrics.")) if args.workers > 1 else None
    settings = OpenAISettings(
        metrics_dir=metrics_dir,
        triton_url=args.triton_url,
        triton_http_url=args.triton_http_url,
        api_keys=api_keys(args.api_key),
        health_model=args.health_model,
        tokenizer_dirs=per_model,
        default_tokenizer_dir=default,
        max_body_bytes=args.max_body_bytes,
        generation_config=args.generation_config,
        chat_template=chat_template_text(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        lora_adapters=parse_lora_adapters(args.lora_adapter),
        allow_runtime_lora_updates=args.allow_runtime_lora_updates,
    )
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    import uvicorn

    options = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "timeout_graceful_shutdown": 3,
        "access_log": args.log_level in ("info", "debug"),
    }
    if args.workers <= 1:
        uvicorn.run(create_app(settings), **options)
        return 0
    bind_error = port_bind_error(args.host, args.port)
    if bind_error is not None:  # (the workers' SO_REUSEPORT sockets would not notice a listener)
        print(f"error: cannot listen on {args.host}:{args.port}: {bind_error}", file=sys.stderr)
        return 1
    os.environ[_SETTINGS_ENV] = settings.to_json()  # the workers build their app from it
    del options["host"], options["port"]
    try:
        return run_workers(
            args.workers, "paged_llm.openai.server:app_from_environment", args.host, args.port, options
        )
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def app_from_environment() -> Any:
    """uvicorn's factory in each worker process (--workers > 1)."""
    return create_app(OpenAISettings.from_json(os.environ[_SETTINGS_ENV]))


if __name__ == "__main__":
    raise SystemExit(main())
