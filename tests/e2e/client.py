"""Small tritonclient helpers for the end-to-end tests (real gRPC streams and HTTP requests)."""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from paged_llm.testing.bench_workload import infer_inputs


@dataclass
class StreamResult:
    responses: list[Any] = field(default_factory=list)  # InferResult of each non-empty response
    finals: int = 0  # responses flagged final
    errors: list[str] = field(default_factory=list)

    def texts(self, name: str = "text_output") -> list[str]:
        out = []
        for response in self.responses:
            array = response.as_numpy(name)
            if array is not None:
                out.append("".join(x.decode("utf-8") for x in array.reshape(-1)[:1]))
        return out

    @property
    def text(self) -> str:
        return "".join(self.texts())

    def last(self, name: str) -> np.ndarray | None:
        for response in reversed(self.responses):
            array = response.as_numpy(name)
            if array is not None:
                return array
        return None


def make_inputs(prompt: str | list[int], **kwargs: Any) -> list[grpcclient.InferInput]:
    tensors: list[tuple[str, np.ndarray, str]] = []
    if isinstance(prompt, str):
        tensors.append(("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"))
    else:
        tensors.append(("input_ids", np.array(prompt, dtype=np.int32), "INT32"))
    for name, value in kwargs.items():
        if isinstance(value, bool):
            tensors.append((name, np.array([value]), "BOOL"))
        elif isinstance(value, dict):
            tensors.append((name, np.array([json.dumps(value).encode()], dtype=np.object_), "BYTES"))
        elif isinstance(value, str | bytes):
            raw = value.encode() if isinstance(value, str) else value
            tensors.append((name, np.array([raw], dtype=np.object_), "BYTES"))
        else:
            raise TypeError(f"unsupported input {name}={value!r}")
    return infer_inputs(grpcclient, tensors)


def stream_many(
    url: str,
    requests: list[list[grpcclient.InferInput]],
    model: str = "llm",
    timeout_s: float = 120.0,
    outputs: list[str] | None = None,
) -> list[StreamResult]:
    """Sends several requests on one gRPC stream; waits for every request's final response.
    `outputs`: ask for these outputs only (default: Triton sends all)."""
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
    events: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    results = [StreamResult() for _ in requests]
    try:
        for index, inputs in enumerate(requests):
            client.async_stream_infer(
                model, inputs, outputs=requested, request_id=str(index), enable_empty_final_response=True
            )
        pending = len(requests)
        deadline = time.monotonic() + timeout_s
        while pending:
            try:
                result, error = events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"{pending} of {len(requests)} requests got no final response within {timeout_s:g} s"
                ) from None
            if error is not None:
                # Errors carry no request id over the stream; the tests send one request per stream
                # whenever they expect an error.
                results[0 if len(requests) == 1 else -1].errors.append(str(error))
                results[0 if len(requests) == 1 else -1].finals += 1
                pending -= 1
                continue
            response = result.get_response()
            target = results[int(response.id)]
            if response.outputs:
                target.responses.append(result)
            if response.parameters["triton_final_response"].bool_param:
                target.finals += 1
                pending -= 1
    finally:
        # Cancelled, not half-closed: tritonclient's close() joins its response thread without a
        # timeout, and once (a loaded CI run, after an error final) Triton 2.51 never ended a stream
        # whose requests had all ended, so the half-close waited forever. Every request has its
        # final here (or the test fails above), so cancelling loses nothing.
        client.stop_stream(cancel_requests=True)
        client.close()
    return results


def stream(url: str, prompt: str | list[int], **kwargs: Any) -> StreamResult:
    return stream_many(url, [make_inputs(prompt, **kwargs)])[0]


def http_post(url: str, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def sse_events(payload: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data:") :]) for line in payload.splitlines() if line.startswith("data:")]
