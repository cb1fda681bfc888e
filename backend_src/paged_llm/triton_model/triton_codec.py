"""numpy tensors -> (prompt, SamplingParams, flags): parsing and validating a request's inputs.

No `triton_python_backend_utils` here: llm_model.py turns pb_utils tensors into numpy arrays and back.
The request contract is docs/api.md (vllm_backend-compatible).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paged_llm.coercion import loads_request_json, parse_bool
from paged_llm.core.sessions import SessionTurn
from paged_llm.engine.outputs import PositionLogprobs
from paged_llm.errors import InvalidRequestError, wire_text
from paged_llm.sampling_params import RequestLimits, SamplingParams
from paged_llm.triton_model.auth import AUTHORIZATION_PARAMETER

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
BOOL_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS)
# A session's turn (docs/api.md): as inputs, or as request parameters of the same names.
SESSION_INPUTS = ("session_id", "session_start", "session_end")
INPUT_NAMES = ("text_input", "input_ids", "sampling_parameters", *BOOL_INPUTS, *SESSION_INPUTS)
# A streaming client that sets this request parameter to true gets finish_reason, num_input_tokens and
# num_output_tokens on the final response only, num_output_tokens then counting the whole request:
# each streamed response before it is text_output alone (one tensor for the stub to build, not four).
TOTALS_ON_FINAL_PARAMETER = "paged_llm_totals_on_final"
# Prompt + max_tokens past max_model_len is INVALID_ARG (OpenAI's and vLLM's OpenAI server's rule),
# not a generation cut at max_model_len (the engine's, and vllm_backend's). The OpenAI server sets it.
CONTEXT_MUST_FIT_PARAMETER = "paged_llm_context_must_fit"
# false: a text prompt is tokenized without the tokenizer's special tokens (a rendered chat template,
# which holds its own BOS); by default they are added, as vLLM (and so vllm_backend) tokenizes text.
ADD_SPECIAL_TOKENS_PARAMETER = "add_special_tokens"
# Comma-separated output names to build: Triton's HTTP generate asks for every output, and a client
# that wants fewer (the OpenAI server) names them here.
OUTPUTS_PARAMETER = "paged_llm_outputs"


@dataclass(frozen=True)
class ParsedRequest:
    prompt_text: str | None  # exactly one of prompt_text / prompt_token_ids is set
    prompt_token_ids: list[int] | None
    stream: bool
    params: SamplingParams
    exclude_input_in_output: bool
    return_flags: frozenset[str] = field(default_factory=frozenset)  # which optional outputs to send
    # The client set `logprobs` in its sampling parameters: without it the logprobs output is JSON
    # null (vllm_backend), though the engine still computes the sampled token's (cumulative_logprob).
    logprobs_requested: bool = False
    # The outputs the client asked for (Triton lists them all when it named none): the others are
    # never built, so a client that wants only text_output costs the stub one tensor per response.
    requested_outputs: frozenset[str] | None = None  # None: all
    totals_on_final: bool = False  # TOTALS_ON_FINAL_PARAMETER (streaming only)
    context_must_fit: bool = False  # CONTEXT_MUST_FIT_PARAMETER
    add_special_tokens: bool = True  # ADD_SPECIAL_TOKENS_PARAMETER (text prompts)
    session: SessionTurn | None = None  # a turn of a session; with session.end and no prompt: a close

    @property
    def closes_session_only(self) -> bool:
        return (
            self.session is not None and self.session.end and not (self.prompt_text or self.prompt_token_ids)
        )


def read_inputs(
    request: Any, names: Iterable[str], get_input_tensor_by_name: Callable[[Any, str], Any]
) -> dict[str, np.ndarray]:
    """The request's input tensors among `names`, as numpy arrays (pass pb_utils' getter in)."""
    arrays = {}
    for name in names:
        tensor = get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def _scalar(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise InvalidRequestError(name, f"expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _as_text(name: str, value: Any, max_bytes: int | None = None) -> str:
    if isinstance(value, bytes | np.bytes_):
        raw = bytes(value)
        if max_bytes is not None and len(raw) > max_bytes:
            raise InvalidRequestError(name, f"is {len(raw)} bytes, more than the limit of {max_bytes}")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError(
                name, f"is not valid UTF-8 ({error.reason} at byte {error.start})"
            ) from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(name, f"must be a string, got {type(value).__name__}")


def _as_bool(name: str, array: np.ndarray) -> bool:
    value = _scalar(name, array)
    if isinstance(value, np.bool_ | bool):
        return bool(value)
    raise InvalidRequestError(name, f"must be BOOL, got {array.dtype}")


def read_request(
    request: Any,
    parameters: str | Mapping[str, Any] | None,
    limits: RequestLimits,
    get_input_tensor_by_name: Callable[[Any, str], Any],
) -> ParsedRequest:
    """A Triton request (pass pb_utils' getter in) and its parameters, parsed in one pass."""
    inputs = read_inputs(request, INPUT_NAMES, get_input_tensor_by_name)
    return parse_request(inputs, parameters, limits, request.requested_output_names())


def parse_request(
    inputs: Mapping[str, np.ndarray],
    request_parameters: str | Mapping[str, Any] | None,
    limits: RequestLimits,
    requested_output_names: Iterable[str] = (),
) -> ParsedRequest:
    """Turns a request's input tensors (and Triton request parameters) into engine inputs: its
    SamplingParams built and checked against `limits` once; the model's checks follow tokenizing."""
    parameters = request_parameter_mapping_raw(request_parameters)
    session = parse_session(inputs, parameters)
    has_text = "text_input" in inputs
    has_ids = "input_ids" in inputs
    if session is not None and session.end and not _has_prompt(inputs):
        outputs = requested_outputs(requested_output_names, parameters)
        return ParsedRequest(  # a close
            None, [], False, SamplingParams(), True, requested_outputs=outputs, session=session
        )
    if has_text == has_ids:
        raise InvalidRequestError("text_input", "give exactly one of text_input or input_ids")
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    if has_text:
        prompt_text = _as_text(
            "text_input", _scalar("text_input", inputs["text_input"]), limits.max_prompt_bytes
        )
        if not prompt_text:
            raise InvalidRequestError("text_input", "the prompt is empty")
    else:
        ids = inputs["input_ids"]
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError("input_ids", f"must be INT32 token ids, got {ids.dtype}")
        prompt_ids = ids.reshape(-1).tolist()  # (Python ints; ~5x faster than a comprehension)
        if not prompt_ids:
            raise InvalidRequestError("input_ids", "the prompt is empty")
    flags = {name: _as_bool(name, inputs[name]) for name in BOOL_INPUTS if name in inputs}
    return_flags = frozenset(name for name in RETURN_FLAGS if flags.get(name, False))
    if "sampling_parameters" in inputs:
        source: str | Mapping[str, Any] = _as_text(
            "sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"])
        )
    else:
        source = {k: v for k, v in _sampling_parameters(parameters).items() if k not in SESSION_INPUTS}
    values = SamplingParams.parse_fields(source, limits)
    logprobs_requested = values.get("logprobs") is not None
    if {"return_logprobs", "return_cumulative_logprob"} & return_flags and not logprobs_requested:
        values["logprobs"] = 0  # the sampled token's logprob only
    params = SamplingParams.from_fields(values, limits)
    if flags.get("stream", False) and flags.get("exclude_input_in_output") is False:
        raise InvalidRequestError.verbatim(  # vllm_backend's words, which its clients compare
            "exclude_input_in_output",
            "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.",
        )
    stream = flags.get("stream", False)
    return ParsedRequest(
        totals_on_final=stream and parameters.get(TOTALS_ON_FINAL_PARAMETER) is True,
        context_must_fit=parameters.get(CONTEXT_MUST_FIT_PARAMETER) is True,
        add_special_tokens=_add_special_tokens(parameters),
        logprobs_requested=logprobs_requested,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_ids,
        stream=stream,
        params=params,
        exclude_input_in_output=flags.get("exclude_input_in_output", False),
        return_flags=return_flags,
        requested_outputs=requested_outputs(requested_output_names, parameters),
        session=session,
    )


def _has_prompt(inputs: Mapping[str, np.ndarray]) -> bool:
    """Whether the request carries prompt tokens or text (a session's close needs neither)."""
    if "input_ids" in inputs and inputs["input_ids"].size:
        return True
    text_input = inputs.get("text_input")
    return text_input is not None and (text_input.size != 1 or bool(text_input.reshape(-1)[0]))


def parse_session(
    inputs: Mapping[str, np.ndarray], request_parameters: str | Mapping[str, Any] | None
) -> SessionTurn | None:
    """The session fields, from inputs or else from request parameters (HTTP generate's top-level
    keys); None when the request names no session."""
    parameters = request_parameter_mapping_raw(request_parameters)
    if "session_id" in inputs:
        session_id: Any = _as_text("session_id", _scalar("session_id", inputs["session_id"]), 256)
    else:
        session_id = parameters.get("session_id")
    flags = {}
    for name in ("session_start", "session_end"):
        if name in inputs:
            flags[name] = _as_bool(name, inputs[name])
        elif name in parameters:
            value = parameters[name]
            if isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            if not isinstance(value, bool):
                raise InvalidRequestError(name, f"must be a boolean, got {value!r}")
            flags[name] = value
    if isinstance(session_id, int) and not isinstance(session_id, bool):
        session_id = str(session_id)  # tritonclient sends integer parameters as such
    if session_id is None:
        if any(flags.values()):
            raise InvalidRequestError("session_id", "session_start and session_end need a session_id")
        return None
    if not isinstance(session_id, str) or not session_id or len(session_id) > 256:
        raise InvalidRequestError("session_id", "must be a non-empty string of at most 256 characters")
    return SessionTurn(
        session_id, start=flags.get("session_start", False), end=flags.get("session_end", False)
    )


# llm_trtllm forwards each request to llm under an id with this prefix, and when its client cancels,
# asks llm to end it with a request that carries only this parameter (Triton 2.51's BLS has no
# cancel; the ids are random, so no other client can name one).
FORWARDED_REQUEST_ID_PREFIX = "paged_llm_trtllm/"
FORWARDED_ABORT_PARAMETER = "paged_llm_abort_forwarded_request"
# Triton 2.51's BLS loses an error response that follows data responses (measured: after some of a
# forwarded request's tokens, llm's CANCELLED final never reached the caller's `exec(decoupled=True)`
# iterator, which waited forever; an error as the first and only response arrives), so llm ends a
# forwarded request that failed with an ordinary FINAL response holding only this output:
# "<label>\t<message>", label as in paged_llm_final_responses_total (cancelled, invalid_arg, ...).
FORWARDED_ERROR_OUTPUT = "paged_llm_error"


# A client that sets this request parameter to true gets its request's error the same way, as an
# ordinary FINAL holding FORWARDED_ERROR_OUTPUT: over a gRPC stream Triton 2.51 passes an error's
# message but not its status code, and the OpenAI server needs the code (400 vs 503 vs 500).
ERROR_OUTPUT_PARAMETER = "paged_llm_error_output"
# Request parameters Triton itself or a client sets for transport; never sampling parameters.
_IGNORED_REQUEST_PARAMETERS = frozenset(
    {
        "triton_enable_empty_final_response",
        ERROR_OUTPUT_PARAMETER,
        TOTALS_ON_FINAL_PARAMETER,
        OUTPUTS_PARAMETER,
        CONTEXT_MUST_FIT_PARAMETER,
        ADD_SPECIAL_TOKENS_PARAMETER,
    }
)


def is_forwarded(triton_request_id: str) -> bool:
    return triton_request_id.startswith(FORWARDED_REQUEST_ID_PREFIX)


def wants_error_output(triton_request_id: str, raw_parameters: str | Mapping[str, Any] | None) -> bool:
    """Whether the request's error goes as FORWARDED_ERROR_OUTPUT (llm_trtllm's, or asked for)."""
    return is_forwarded(triton_request_id) or request_flag(raw_parameters, ERROR_OUTPUT_PARAMETER)


def request_flag(raw_parameters: str | Mapping[str, Any] | None, name: str) -> bool:
    """Whether request parameter `name` is JSON true (the JSON is parsed only when it names it)."""
    if not raw_parameters or name not in raw_parameters:
        return False
    try:
        return request_parameter_mapping_raw(raw_parameters).get(name) is True
    except InvalidRequestError:
        return False


def has_request_parameter(raw_parameters: str | Mapping[str, Any] | None, name: str) -> bool:
    """Whether the request has parameter `name` (as a key: the JSON is parsed only when its text
    holds the name, which a value may too, e.g. a stop string)."""
    if not raw_parameters or name not in raw_parameters:
        return False
    return name in request_parameter_mapping_raw(raw_parameters)


def _add_special_tokens(parameters: Mapping[str, Any]) -> bool:
    if ADD_SPECIAL_TOKENS_PARAMETER not in parameters:
        return True
    return parse_bool(ADD_SPECIAL_TOKENS_PARAMETER, parameters[ADD_SPECIAL_TOKENS_PARAMETER])


def encode_forwarded_error(label: str, message: str) -> np.ndarray:
    return np.array([wire_text(f"{label}\t{message}").encode()], dtype=np.object_)


def decode_forwarded_error(array: np.ndarray) -> tuple[str, str]:
    item = array.reshape(-1)[0]
    text = item.decode(errors="replace") if isinstance(item, bytes) else str(item)
    label, _, message = text.partition("\t")
    return label, message


def request_parameter_mapping_raw(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's Triton parameters as a dict (all of them; a dict is returned as it is)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw  # parsed already (the stub parses a request's parameters once, in execute)
    if isinstance(raw, str):
        mapping = loads_request_json(raw, "parameters")
    else:
        mapping = dict(raw)
    if not isinstance(mapping, dict):
        raise InvalidRequestError("parameters", "must be a JSON object")
    return mapping


def request_parameter_mapping(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's Triton parameters (HTTP generate turns unknown top-level keys into these), less
    the ones Triton's clients and ours set for transport, and a forwarded authorization header."""
    return _sampling_parameters(request_parameter_mapping_raw(raw))


def _sampling_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in parameters.items()
        if k not in _IGNORED_REQUEST_PARAMETERS and k.lower() != AUTHORIZATION_PARAMETER
    }


def requested_outputs(
    requested_names: Iterable[str], raw_parameters: str | Mapping[str, Any] | None
) -> frozenset[str] | None:
    """The outputs to build (None: all): the ones the request names, narrowed by OUTPUTS_PARAMETER."""
    names = frozenset(requested_names)
    if has_request_parameter(raw_parameters, OUTPUTS_PARAMETER):
        value = request_parameter_mapping_raw(raw_parameters).get(OUTPUTS_PARAMETER)
        if not isinstance(value, str):
            raise InvalidRequestError(OUTPUTS_PARAMETER, "must be a string of comma-separated output names")
        chosen = frozenset(name.strip() for name in value.split(",") if name.strip())
        names = names & chosen if names else chosen
    return names or None


def authorization_of(raw: str | Mapping[str, Any] | None) -> str | None:
    """The `authorization` header Triton forwarded as a request parameter (any letter case)."""
    if not raw:
        return None
    for key, value in request_parameter_mapping_raw(raw).items():
        if key.lower() == AUTHORIZATION_PARAMETER:
            return str(value)
    return None


def logprobs_json(positions: list[PositionLogprobs]) -> str:
    """vllm_backend's format: a list, per position, of {token_id: {logprob, rank, decoded_token}}."""
    encoded = []
    for position in positions:
        entry = {
            str(position.token_id): {
                "logprob": position.logprob,
                "rank": position.rank,
                "decoded_token": position.decoded_token,
            }
        }
        for top in position.top:
            entry.setdefault(
                str(top.token_id),
                {"logprob": top.logprob, "rank": top.rank, "decoded_token": top.decoded_token},
            )
        encoded.append(entry)
    return json.dumps(encoded, ensure_ascii=False)
