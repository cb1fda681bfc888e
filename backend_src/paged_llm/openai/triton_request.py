"""What one generation request to a Triton model with vllm_backend's interface holds, and what its
responses become, whichever transport carries them (triton_grpc.py, triton_http.py).

`request_inputs` is the one place a request's inputs are named (docs/api.md): the gRPC
protobuf and the HTTP generate body are both built from it, so a new flag cannot reach one
transport only. The parameter names here are the ones our llm model reads
(triton_model/triton_codec.py; this package does not import the engine's, a unit test ties them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ERROR_OUTPUT = "paged_llm_error"  # "<label>\t<message>" on our llm model's final response
ERROR_OUTPUT_PARAMETER = "paged_llm_error_output"  # asks our llm model for ERROR_OUTPUT
# Streamed without logprobs, our llm model sends finish_reason and the token counts on the final
# response only (num_output_tokens then the request's total): the others carry text_output alone,
# which measurably lowers the stub's cost per response at high concurrency.
TOTALS_ON_FINAL_PARAMETER = "paged_llm_totals_on_final"
OUTPUTS_PARAMETER = "paged_llm_outputs"  # comma-separated names of the outputs our llm model builds
# Prompt + max_tokens past the context is a 400 (OpenAI's rule), not a generation cut short.
CONTEXT_MUST_FIT_PARAMETER = "paged_llm_context_must_fit"
# Whether a text prompt gets the tokenizer's special tokens (completions: yes, chat: no, as vLLM does).
ADD_SPECIAL_TOKENS_PARAMETER = "add_special_tokens"
# What the routes read of our llm model (logprobs added when asked for).
PAGED_LLM_OUTPUTS = ("text_output", "num_output_tokens", "finish_reason", "num_input_tokens", ERROR_OUTPUT)


@dataclass
class GenerationRequest:
    model: str
    prompt: str | list[int]  # text, or token ids
    sampling_parameters: dict[str, Any]
    stream: bool  # one response per engine step (else one at the end)
    want_logprobs: bool
    request_id: str
    # A session's turn (X-Session-Id etc.): {"session_id": str, "session_start": bool, "session_end": bool}
    session: dict[str, Any] | None = None
    add_special_tokens: bool = True  # for a text prompt (a chat template's text holds its own)


def request_inputs(request: GenerationRequest) -> dict[str, str | list[int] | bool]:
    """The request's inputs by name: a str is a one-element BYTES input, a list of ints INT32 token
    ids, a bool a one-element BOOL flag."""
    inputs: dict[str, str | list[int] | bool] = {}
    if isinstance(request.prompt, str):
        inputs["text_input"] = request.prompt
    else:
        inputs["input_ids"] = request.prompt
    inputs["sampling_parameters"] = json.dumps(request.sampling_parameters)
    inputs["stream"] = request.stream
    inputs["exclude_input_in_output"] = True  # echo is ours to do
    inputs["return_finish_reason"] = True
    inputs["return_num_input_tokens"] = True
    inputs["return_num_output_tokens"] = True
    inputs["return_logprobs"] = request.want_logprobs
    if request.session is not None:
        inputs["session_id"] = str(request.session["session_id"])
        inputs["session_start"] = bool(request.session.get("session_start"))
        inputs["session_end"] = bool(request.session.get("session_end"))
    return inputs


class StreamRefused(Exception):
    """Triton or the model refused the request or failed it, with a message only (Triton's own
    errors, other models' errors; our llm model sends its errors as ERROR_OUTPUT instead)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TritonUnreachable(Exception):
    """The transport failed. `reached`: Triton had answered this request (gRPC: a response came,
    or the call failed other than UNAVAILABLE; HTTP: the response's status line came), so the
    stream broke rather than never started."""

    def __init__(self, message: str, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached


@dataclass
class SequenceDelta:
    """What one response adds to sample `index`."""

    index: int
    text: str
    num_tokens: int  # new tokens of this sample in this response
    token_ids: list[int]  # their ids, when the model sent output_ids (empty otherwise)
    logprobs: (
        list[dict[str, dict[str, Any]]] | None
    )  # per position: {token_id: {logprob, rank, decoded_token}}
    finish_reason: str | None
    total_tokens: int | None = None  # the sample's tokens in all (paged_llm_totals_on_final's final)


@dataclass
class GenerationChunk:
    sequences: list[SequenceDelta] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    is_final: bool = False


def parse_outputs(
    outputs: dict[str, list[Any]], is_final: bool, totals_on_final: bool = False
) -> GenerationChunk:
    """One Triton response (outputs as lists) -> a chunk (text, ids split per sample by
    num_output_tokens). `totals_on_final`: the request set paged_llm_totals_on_final (no
    output_ids, no logprobs)."""
    texts = outputs.get("text_output", [])
    ids = outputs.get("output_ids", [])
    counts = outputs.get("num_output_tokens")
    totals = None
    if totals_on_final:
        totals, counts = counts, None
    if counts is None:
        counts = [len(ids)]
    reasons = outputs.get("finish_reason") if is_final else None
    logprobs = outputs.get("logprobs")
    num_input = outputs.get("num_input_tokens")
    chunk = GenerationChunk(num_prompt_tokens=num_input[0] if num_input else None, is_final=is_final)
    offset = 0
    for index, text in enumerate(texts):
        count = counts[index] if index < len(counts) else 0
        positions = json.loads(logprobs[index]) if logprobs and index < len(logprobs) else None
        reason = reasons[index] if reasons and index < len(reasons) else None
        chunk.sequences.append(
            SequenceDelta(
                index=index,
                text=text,
                num_tokens=count,
                token_ids=ids[offset : offset + count] if ids else [],
                logprobs=positions,
                finish_reason=None if reason in (None, "None") else reason,
                total_tokens=totals[index] if totals and index < len(totals) else None,
            )
        )
        offset += count
    return chunk
