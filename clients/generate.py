"""Stream a completion from the `llm` model and print the text as it arrives.

  gRPC (default):  python clients/generate.py --url 127.0.0.1:8001 "What is a paged KV cache?"
  HTTP streaming:  python clients/generate.py --http --url 127.0.0.1:8000 "What is a paged KV cache?"

Sampling parameters: --max-tokens, --temperature, --top-p, --top-k, --seed, --stop, or any JSON
object with --params '{"min_p": 0.1}'. Works against any vllm_backend-compatible Triton model.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import urllib.request
from typing import Any


def build_parameters(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.top_k is not None:
        params["top_k"] = args.top_k
    if args.seed is not None:
        params["seed"] = args.seed
    if args.stop:
        params["stop"] = args.stop
    params.update(json.loads(args.params))
    return params


def finish_reason(value: Any) -> str | None:
    """The reason the answer ended, None while it goes on: Triton's streamed responses carry the
    text "None" (vllm_backend's str(None)) until the last, which a user need not see every token."""
    reasons = value if isinstance(value, list) else [value]
    real = [str(reason) for reason in reasons if reason not in (None, "", "None")]
    return ", ".join(real) if real else None


def stream_grpc(url: str, model: str, prompt: str, params: dict[str, Any], timeout_s: float) -> int:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, value, dtype in (
        ("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
        ("stream", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ):
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                message = error.message() if isinstance(error, InferenceServerException) else str(error)
                print(f"\nerror: {message}", file=sys.stderr)
                return 1
            response = result.get_response()
            text = result.as_numpy("text_output")
            if text is not None:
                print("".join(t.decode("utf-8") for t in text), end="", flush=True)
            if response.parameters["triton_final_response"].bool_param:
                reasons = result.as_numpy("finish_reason")
                reason = finish_reason(reasons[0].decode()) if reasons is not None else None
                if reason is not None:
                    print(f"\n[finish_reason: {reason}]", file=sys.stderr)
                return 0
    finally:
        client.stop_stream()
        client.close()


def stream_http(url: str, model: str, prompt: str, params: dict[str, Any], timeout_s: float) -> int:
    body = json.dumps(
        {
            "text_input": prompt,
            "stream": True,
            "sampling_parameters": json.dumps(params),
            "return_finish_reason": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for raw_line in response:
                line = raw_line.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:") :])
                if "error" in event:
                    print(f"\nerror: {event['error']}", file=sys.stderr)
                    return 1
                print(event.get("text_output", ""), end="", flush=True)
                reason = finish_reason(event.get("finish_reason"))
                if reason is not None:
                    print(f"\n[finish_reason: {reason}]", file=sys.stderr)
    except urllib.error.HTTPError as error:
        print(f"error: HTTP {error.code}: {error.read().decode()}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt")
    parser.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC, :8000 HTTP)")
    parser.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--params", default="{}", help="extra sampling parameters as a JSON object")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the whole answer")
    args = parser.parse_args(argv)
    params = build_parameters(args)
    if args.http:
        return stream_http(args.url or "127.0.0.1:8000", args.model, args.prompt, params, args.timeout)
    return stream_grpc(args.url or "127.0.0.1:8001", args.model, args.prompt, params, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
