"""Chat in the terminal over one session of the `llm` model: the server keeps the conversation (its
KV cache too), so each line you type is sent alone, as the session's next turn.

  python clients/chat.py --url 127.0.0.1:8001
  printf 'Hello\nTell me more\n' | python clients/chat.py --url 127.0.0.1:8001   (one turn per line)

Type /quit (or end the input) to close the session; Ctrl-C during an answer cancels that turn and
keeps the session. Each turn is wrapped in the ChatML markers of Qwen models (--raw sends lines as
they are). A turn that no longer fits the session window drops the middle of the history; the
server says how many tokens it dropped and this client prints it.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import uuid
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def chatml_turn(text: str, system: str | None, first: bool) -> str:
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if first and system else ("" if first else "\n")
    return f"{head}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def turn_inputs(text: str, session_id: str, start: bool, end: bool, params: dict[str, Any]) -> list[Any]:
    tensors = [
        ("text_input", np.array([text.encode("utf-8")], dtype=np.object_), "BYTES"),
        ("session_id", np.array([session_id.encode()], dtype=np.object_), "BYTES"),
        ("session_start", np.array([start]), "BOOL"),
        ("session_end", np.array([end]), "BOOL"),
        ("stream", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
    ]
    inputs = []
    for name, value, dtype in tensors:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


class Chat:
    def __init__(self, url: str, model: str, params: dict[str, Any], timeout_s: float) -> None:
        self.model = model
        self.params = params
        self.timeout_s = timeout_s
        self.session_id = f"chat-{uuid.uuid4().hex[:12]}"
        self.started = False
        self.events: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def turn(self, text: str, end: bool = False) -> bool:
        """Sends one turn and prints the answer as it streams; False if the server refused it."""
        for _ in range(50):
            error = self._turn(text, end)
            # A turn cancelled just before may still be ending on the server: wait for it.
            if error is None or "already has a turn in flight" not in error:
                break
            time.sleep(0.1)
        if error is not None:
            print(f"\n[error: {error}]", file=sys.stderr, flush=True)
        return error is None

    def _turn(self, text: str, end: bool) -> str | None:
        request_id = uuid.uuid4().hex
        inputs = turn_inputs(text, self.session_id, not self.started, end, self.params)
        self.client.async_stream_infer(
            self.model, inputs, request_id=request_id, enable_empty_final_response=True
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            result, error = self.events.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                return error.message() if isinstance(error, InferenceServerException) else str(error)
            response = result.get_response()
            if response.id != request_id:
                continue  # the end of a turn cancelled earlier
            self.started = True  # the server took the turn: the session is open
            dropped = result.as_numpy("history_truncated")
            if dropped is not None:
                print(f"[history truncated: {int(dropped[0])} tokens dropped]", file=sys.stderr, flush=True)
            text_output = result.as_numpy("text_output")
            if text_output is not None:
                print(text_output[0].decode("utf-8", errors="replace"), end="", flush=True)
            if response.parameters["triton_final_response"].bool_param:
                print(flush=True)
                return None

    def close(self) -> None:
        if self.started:
            self.turn("", end=True)  # no new tokens: closes the session, generates nothing
        self.client.stop_stream()  # a half-close: every request on the stream has ended
        self.client.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--system", default=None, help="a system prompt for the first turn")
    parser.add_argument("--raw", action="store_true", help="send lines as they are (no ChatML markers)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--params", default="{}", help="more sampling parameters, as a JSON object")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one answer")
    args = parser.parse_args()
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, **json.loads(args.params)}
    chat = Chat(args.url, args.model, params, args.timeout)
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "/quit":
                break
            if not line.strip():
                continue
            text = line.rstrip("\n") if args.raw else chatml_turn(line.strip(), args.system, not chat.started)
            try:
                chat.turn(text)
            except KeyboardInterrupt:  # cancel this answer only: the session goes on
                print("\n[cancelled]", file=sys.stderr)
                chat.client.stop_stream(cancel_requests=True)
                chat.client.start_stream(callback=lambda result, error: chat.events.put((result, error)))
    finally:
        chat.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
