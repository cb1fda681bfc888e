"""TensorRT-LLM client convention <-> the `llm` model's vllm_backend-style tensors (no pb_utils here).

TensorRT-LLM's ensemble / BLS models take one tensor per sampling knob, with a batch dimension
(clients send shapes [1, 1]), and answer with `output_ids` [batch, beam, tokens] etc. The
`llm_trtllm` model converts a request with this module, forwards it to `llm`, and converts each
response back, so one engine serves both conventions.

Sampling follows TensorRT-LLM: with neither `top_k` nor `top_p` set (or both 0) decoding is greedy.

Guided decoding follows tensorrtllm_backend's two inputs (its tensorrt_llm model's
`get_guided_decoding_params_from_request`, and TensorRT-LLM's GuidedDecodingParams):
`guided_decoding_guide_type` names the kind and `guided_decoding_guide` holds its text; they become the
llm model's `structured_outputs` (GUIDE_TYPES). tensorrtllm_backend's C++ model ignores a guide type
it does not know, and a guide without a type, and so decodes unconstrained: here those are INVALID_ARG
naming the input, as is a type that needs a guide and has none.

Two response layouts: `tensorrt_llm` (the `tensorrt_llm` model's tensors: `text_output` [1, 1],
`output_ids` [1, 1, tokens], `sequence_length`) for `llm_trtllm`, and `ensemble` (what TensorRT-LLM's
`ensemble` and `tensorrt_llm_bls` models answer after postprocessing: `text_output` 1-D, one entry,
and `batch_index` [1, 1]) for the models of those names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from paged_llm.errors import InvalidRequestError
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_output_params import FIELD as STRUCTURED_OUTPUTS
from paged_llm.triton_model.triton_codec import request_parameter_mapping

# name -> (sampling parameter it becomes, kind)
_SCALARS: dict[str, tuple[str, str]] = {
    "max_tokens": ("max_tokens", "int"),
    "temperature": ("temperature", "float"),
    "top_k": ("top_k", "int"),
    "runtime_top_k": ("top_k", "int"),
    "top_p": ("top_p", "float"),
    "runtime_top_p": ("top_p", "float"),
    "repetition_penalty": ("repetition_penalty", "float"),
    "presence_penalty": ("presence_penalty", "float"),
    "frequency_penalty": ("frequency_penalty", "float"),
    "seed": ("seed", "int"),
    "random_seed": ("seed", "int"),
    "min_tokens": ("min_tokens", "int"),
    "min_length": ("min_tokens", "int"),
}
# Inputs that become an llm sampling parameter of another name.
_LIST_INPUTS = {"stop_words": "stop", "bad_words": "bad_words", "end_id": "stop_token_ids"}
# TensorRT-LLM inputs this engine has no use for, and what a request gets when it sets them.
_UNSUPPORTED_INPUTS = {
    "decoder_text_input": "encoder-decoder models are not supported",
    "image_input": "multimodal inputs are not supported",
    "prompt_embedding_table": "prompt tuning (p-tuning tables) is not supported",
    "prompt_table_extra_id": "prompt tuning (p-tuning tables) is not supported",
    "prompt_vocab_size": "prompt tuning (p-tuning tables) is not supported",
    "embedding_bias_words": "embedding bias is not supported (use bad_words to ban words)",
    "embedding_bias_weights": "embedding bias is not supported (use bad_words to ban words)",
}
# guided_decoding_guide_type -> the structured_outputs kind. tensorrtllm_backend knows these four;
# TensorRT-LLM's executor also has a structural tag, which no Triton input of it can ask for.
# `json` is TensorRT-LLM's kJSON, xgrammar's builtin JSON grammar (its LLM API calls it json_object):
# here a JSON object (xgrammar's builtin grammar also admits a top-level array).
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
INPUT_NAMES = (
    "text_input",
    "stream",
    "exclude_input_in_output",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "beam_width",
    "num_return_sequences",
    "end_id",
    "pad_id",
    "length_penalty",
    "stop_words",
    "bad_words",
    GUIDE_TYPE_INPUT,
    GUIDE_INPUT,
    *_SCALARS,
    *_UNSUPPORTED_INPUTS,
)
DEFAULT_MAX_TOKENS = 16
LAYOUTS = ("tensorrt_llm", "ensemble")


@dataclass(frozen=True)
class ForwardRequest:
    inputs: dict[str, np.ndarray]  # tensors for the `llm` model
    stream: bool
    exclude_input_in_output: bool
    return_log_probs: bool
    guide_kind: str | None = None  # the structured_outputs kind its guided decoding inputs became


def _single(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise InvalidRequestError(
            name,
            f"expected one value per prompt (shape [1, 1], or [batch, 1]), got shape {list(array.shape)}",
        )
    return array.reshape(-1)[0]


def _number(name: str, array: np.ndarray, kind: str) -> int | float:
    value = _single(name, array)
    if isinstance(value, bytes | np.bytes_ | str | np.bool_ | bool):
        raise InvalidRequestError(name, f"must be numeric, got {array.dtype}")
    if kind == "int":
        if not np.issubdtype(array.dtype, np.integer):
            raise InvalidRequestError(name, f"must be an integer tensor, got {array.dtype}")
        return int(value)
    return float(value)


def _flag(name: str, array: np.ndarray | None) -> bool:
    if array is None:
        return False
    value = _single(name, array)
    if not isinstance(value, np.bool_ | bool):
        raise InvalidRequestError(name, f"must be BOOL, got {array.dtype}")
    return bool(value)


def _text(name: str, array: np.ndarray) -> str:
    raw = _single(name, array)
    if not isinstance(raw, bytes | np.bytes_):
        raise InvalidRequestError(name, "must be a BYTES string")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError(name, "is not valid UTF-8") from None


def _guided_decoding(inputs: Mapping[str, np.ndarray]) -> tuple[str, Any] | None:
    """(structured_outputs kind, its value) of the guided decoding inputs; None when they ask for
    none (absent, or empty strings as TensorRT-LLM's clients send for "unset")."""
    guide_type = _text(GUIDE_TYPE_INPUT, inputs[GUIDE_TYPE_INPUT]) if GUIDE_TYPE_INPUT in inputs else ""
    guide = _text(GUIDE_INPUT, inputs[GUIDE_INPUT]) if GUIDE_INPUT in inputs else ""
    if not guide_type:
        if guide:
            raise InvalidRequestError(
                GUIDE_INPUT, f"a guide needs {GUIDE_TYPE_INPUT} ({', '.join(GUIDE_TYPES)}) to say what it is"
            )
        return None
    kind = GUIDE_TYPES.get(guide_type)
    if kind is None:
        raise InvalidRequestError(
            GUIDE_TYPE_INPUT, f"unknown guide type {guide_type!r} (known: {', '.join(GUIDE_TYPES)})"
        )
    if kind == "json_object":
        if guide:
            raise InvalidRequestError(
                GUIDE_INPUT, "guide type json takes no guide (any JSON object); use json_schema for a schema"
            )
        return kind, True
    if not guide:
        raise InvalidRequestError(GUIDE_INPUT, f"guide type {guide_type} needs a guide (the {kind} text)")
    return kind, guide


def _as_guide(text: str, kind: str | None) -> str:
    """`text` (a field, or an error message that starts with one) naming guided_decoding_guide where
    it names the structured_outputs the guide became: structured_outputs.json/properties/x/not ->
    guided_decoding_guide/properties/x/not."""
    prefix = f"{STRUCTURED_OUTPUTS}.{kind}"
    if kind is not None and text.startswith(prefix) and text[len(prefix) : len(prefix) + 1] in ("", "/", ":"):
        return GUIDE_INPUT + text[len(prefix) :]
    return text


def client_error_text(request: ForwardRequest, message: str) -> str:
    """An error of the llm model about this request, as this client knows its inputs: a fault of the
    structured output (over max_grammar_bytes, a regex that did not compile) names the guide."""
    return _as_guide(message, request.guide_kind)


def _words(name: str, array: np.ndarray) -> list[str]:
    words = []
    for raw in array.reshape(-1):
        if not isinstance(raw, bytes | np.bytes_):
            raise InvalidRequestError(name, "must be BYTES strings")
        try:
            word = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(name, "is not valid UTF-8") from None
        if word:
            words.append(word)
    return words


MAX_BATCH_SIZE = 64  # the ensemble names' max_batch_size (config.pbtxt)


def split_batch(inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A request's inputs, one dict per row of its batch (Triton checked that every input has the
    same batch size); each row then becomes its own llm request."""
    if "text_input" not in inputs:
        raise InvalidRequestError("text_input", "is required")
    num_rows = inputs["text_input"].shape[0] if inputs["text_input"].ndim > 1 else 1
    if num_rows <= 1:
        return [dict(inputs)]
    return [{name: array[row : row + 1] for name, array in inputs.items()} for row in range(num_rows)]


def _check_sampling(params: dict[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
    """The llm model's range checks, here, so that an error names the input this client sent
    (`end_id`, `runtime_top_p`), not the llm parameter it became. Server caps (max_tokens_cap, ...)
    are the llm model's to apply; its errors name the llm parameter."""
    try:
        SamplingParams.from_mapping(params)
    except InvalidRequestError as error:
        guided = params.get(STRUCTURED_OUTPUTS)
        if guided and (field := _as_guide(error.field, next(iter(guided)))) != error.field:
            raise InvalidRequestError(field, str(error).split(": ", 1)[-1]) from None
        sent = [name for name, (target, _) in _SCALARS.items() if target == error.field and name in inputs]
        sent += [name for name, target in _LIST_INPUTS.items() if target == error.field and name in inputs]
        if not sent or sent == [error.field]:
            raise
        message = str(error).split(": ", 1)[-1]
        raise InvalidRequestError(sent[0], message) from None


def to_llm_request(inputs: Mapping[str, np.ndarray]) -> ForwardRequest:
    if "text_input" not in inputs:
        raise InvalidRequestError("text_input", "is required")
    text = _single("text_input", inputs["text_input"])
    for name, reason in _UNSUPPORTED_INPUTS.items():
        if name in inputs and inputs[name].size > 0:
            raise InvalidRequestError(name, reason)
    for name in ("beam_width", "num_return_sequences"):
        if name in inputs and (count := _number(name, inputs[name], "int")) != 1:
            raise InvalidRequestError(
                name, f"only 1 is supported (no beam search, one sequence), got {count}"
            )
    for name in ("return_context_logits", "return_generation_logits"):
        if _flag(name, inputs.get(name)):
            raise InvalidRequestError(name, "returning logits is not supported (use return_log_probs)")
    # Accepted for compatibility, no effect: the engine never pads, and length_penalty only scores beams.
    if "pad_id" in inputs:
        _number("pad_id", inputs["pad_id"], "int")
    if "length_penalty" in inputs:
        _number("length_penalty", inputs["length_penalty"], "float")
    params: dict[str, Any] = {}
    for name, (target, kind) in _SCALARS.items():
        if name in inputs:
            params[target] = _number(name, inputs[name], kind)
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    # TensorRT-LLM: top_k == 0 and top_p == 0 mean "off", and with both off decoding is greedy.
    if params.get("top_p") == 0.0:
        params.pop("top_p")
    if params.get("top_k") == 0:
        params.pop("top_k")
    if "top_k" not in params and "top_p" not in params:
        params["temperature"] = 0.0
    if "stop_words" in inputs:
        words = _words("stop_words", inputs["stop_words"])
        if words:
            params["stop"] = words
    if "bad_words" in inputs:
        words = _words("bad_words", inputs["bad_words"])
        if words:
            params["bad_words"] = words
    if "end_id" in inputs:
        params["stop_token_ids"] = [_number("end_id", inputs["end_id"], "int")]
    guided = _guided_decoding(inputs)
    if guided is not None:
        params[STRUCTURED_OUTPUTS] = {guided[0]: guided[1]}
    _check_sampling(params, inputs)
    stream = _flag("stream", inputs.get("stream"))
    exclude = _flag("exclude_input_in_output", inputs.get("exclude_input_in_output"))
    return_log_probs = _flag("return_log_probs", inputs.get("return_log_probs"))
    if return_log_probs:
        params["logprobs"] = 0  # the sampled token's, per position (without it llm sends null)
    llm_inputs: dict[str, np.ndarray] = {
        "text_input": np.array([text], dtype=np.object_),
        "stream": np.array([stream]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    }
    if not stream:  # llm refuses an explicit false with stream (vllm_backend); it never echoes then
        llm_inputs["exclude_input_in_output"] = np.array([exclude])
    if return_log_probs:
        llm_inputs["return_logprobs"] = np.array([True])
        llm_inputs["return_cumulative_logprob"] = np.array([True])
    return ForwardRequest(
        llm_inputs, stream, exclude, return_log_probs, guide_kind=guided[0] if guided else None
    )


class TrtllmResponseState:
    """Turns `llm` responses into TensorRT-LLM-shaped outputs; tracks totals for sequence_length."""

    def __init__(self, request: ForwardRequest, layout: str = "tensorrt_llm", batch_index: int = 0) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"response_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.request = request
        self.layout = layout
        self.batch_index = batch_index  # the row of the client's batch (ensemble layout)
        self.num_input_tokens = 0
        self.num_output_tokens = 0

    def convert(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        text = outputs.get("text_output", np.array([b""], dtype=np.object_)).reshape(-1)[:1]
        ids = outputs.get("output_ids", np.zeros(0, dtype=np.int32)).astype(np.int32)
        if "num_input_tokens" in outputs:
            self.num_input_tokens = int(outputs["num_input_tokens"].reshape(-1)[0])
        self.num_output_tokens += int(ids.size)
        total = self.num_output_tokens + (
            0 if self.request.exclude_input_in_output else self.num_input_tokens
        )
        if self.layout == "ensemble":
            converted = {
                "text_output": text.reshape(1),
                "batch_index": np.array([[self.batch_index]], dtype=np.int32),
            }
        else:
            converted = {
                "text_output": text.reshape(1, 1),
                "output_ids": ids.reshape(1, 1, -1),
                "sequence_length": np.array([[total]], dtype=np.int32),
            }
        if self.request.return_log_probs:
            converted["cum_log_probs"] = outputs.get("cumulative_logprob", np.zeros(1, np.float32)).reshape(
                1, 1
            )
            converted["output_log_probs"] = _sampled_logprobs(outputs.get("logprobs")).reshape(1, 1, -1)
        return converted


def _sampled_logprobs(logprobs: np.ndarray | None) -> np.ndarray:
    """The sampled token's logprob per position, from the llm model's logprobs JSON."""
    if logprobs is None or logprobs.size == 0:
        return np.zeros(0, dtype=np.float32)
    positions = json.loads(bytes(logprobs.reshape(-1)[0]).decode("utf-8"))
    # Each position's first entry is the sampled token (the llm model writes it first).
    return np.array([next(iter(p.values()))["logprob"] for p in positions], dtype=np.float32)


def check_request_parameters(raw: str | Mapping[str, Any] | None) -> None:
    """llm_trtllm takes every setting as an input tensor: a request parameter (on HTTP generate, any
    top-level key that is not an input, e.g. a misspelled `temprature`) is an error, not ignored."""
    unknown = sorted(request_parameter_mapping(raw))
    if unknown:
        raise InvalidRequestError(
            unknown[0], f"unknown input or parameter (inputs: {', '.join(sorted(INPUT_NAMES))})"
        )
