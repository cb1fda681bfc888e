"""Request bodies of /v1/completions and /v1/chat/completions, validated at the edge.

Unknown fields are rejected with 400 "Unrecognized request argument supplied: NAME", as OpenAI's
API does. Besides OpenAI's fields, the vLLM extras our engine implements are accepted (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, bad_words, skip_special_tokens,
include_stop_str_in_output, structured_outputs and the older guided_*; chat: add_generation_prompt,
chat_template_kwargs). Ranges checked here are OpenAI's; the engine checks its own limits (max_n,
max_model_len, vocabulary) and answers INVALID_ARG naming the field, which becomes a 400 too. Output
constraints are checked in constraints.py, tools in tools.py (both called from check_unsupported).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from paged_llm.coercion import lone_surrogate_field
from paged_llm.openai import fast_json
from paged_llm.openai.constraints import Constraint, request_constraint, two_constraints
from paged_llm.openai.errors import OpenAIError, bad_request
from paged_llm.openai.tools import ToolDefinition, ToolUse, history_tool_calls, tool_use

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # the llm model takes INT32 ids
MAX_PROMPTS = 2048  # OpenAI's limit on a completions prompt list
MAX_CHOICES = 2048  # prompts x n of one request
# What the server passes to the chat template itself (apply_chat_template's parameters, and the
# names it renders the template with): chat_template_kwargs may not set them (a client-supplied
# template would run arbitrary Jinja loops in the server; the others collide with the server's).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "tokenize", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "conversation", "conversations", "messages", "sanitize_control_tokens",
     "self"}
)  # fmt: skip


class _Body(BaseModel):
    # strict: JSON types as OpenAI's API takes them (no "2" for 2, no true for 1; ints do for floats)
    model_config = ConfigDict(extra="forbid", strict=True)
    # Fields OpenAI types "X or null" whose null means the default (the SDK sends null for a None
    # it is given): dropped before validation.
    _null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_that_mean_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls._null_means_default and None in data.values():
            return {k: v for k, v in data.items() if v is not None or k not in cls._null_means_default}
        return data

    def check_unsupported(self) -> None:
        """A 400 for fields the schema takes but this server does not serve (parse_body asks)."""


class StreamOptions(_Body):
    _null_means_default = frozenset({"include_usage"})
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # (the schema is always enforced whole, or refused)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    _null_means_default = frozenset(
        {"n", "stream", "echo", "logprobs", "add_generation_prompt", "continue_final_message"}
    )
    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None  # accepted and not used (OpenAI: for abuse monitoring)
    # OpenAI fields that ask nothing of the generation: accepted and not used (nothing is stored)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    priority: int | None = None  # vLLM's: lower runs sooner (the engine's scheduling priority)
    add_special_tokens: bool | None = None  # vLLM's: null = the route's default (completions yes, chat no)
    logit_bias: dict[str, float] | None = None  # only empty / null: the engine has no logit bias
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Output constraints (constraints.py): OpenAI's, vLLM's and vLLM's older ones; one per request
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, not used: there is one backend (xgrammar)
    guided_whitespace_pattern: str | None = None  # only empty (structured_outputs.disable_any_whitespace)

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        _ = self.constraint  # checked now: a bad one is the request's 400

    @functools.cached_property
    def constraint(self) -> Constraint | None:
        """The output constraint the client asked for, checked (constraints.py)."""
        return request_constraint(self)

    def common_sampling(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The llm model's sampling_parameters (API.md): only what the client set, plus max_tokens
        (None: up to max_model_len)."""
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "n": self.n}
        for name in (
            "temperature",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "stop_token_ids",
            "bad_words",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "priority",
        ):
            value = getattr(self, name)
            if value is not None:
                sampling[name] = value
        if self.stop is not None:
            sampling["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if logprobs is not None:
            sampling["logprobs"] = logprobs
        return sampling

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # Token ids first, tried in order: a 512-id prompt validated in 27 us instead of 82 (pydantic's
    # smart union validates every member). A failure names only `prompt` (_first_validation_error).
    prompt: list[TokenId] | str | list[str] | list[list[TokenId]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be empty", "prompt")
        num_prompts = len(self.prompts())
        if num_prompts > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {num_prompts}", "prompt")
        if num_prompts * self.n > MAX_CHOICES:
            raise bad_request(f"prompts x n is {num_prompts * self.n}, more than {MAX_CHOICES}", "n")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")

    @functools.cached_property
    def _prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        # (validated: a list whose first item is an int is a list of token ids)
        if not prompt or type(prompt[0]) is int:
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids (computed once; do not modify)."""
        return self._prompts

    def sampling_parameters(self) -> dict[str, Any]:
        return self.common_sampling(self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(
        extra="allow", strict=True
    )  # e.g. tool_call_id, reasoning_content: kept for the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        """What the chat template sees: content as one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"content part type {part.get('type')!r} is not supported (text only)",
                        f"messages[{index}].content[{part_index}]",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM joins a message's text parts
        message = self.model_dump(exclude_none=True)
        message["content"] = content if content is not None else ""
        if self.role == "assistant" and message.get("tool_calls") is not None:
            message["tool_calls"] = history_tool_calls(message["tool_calls"], f"messages[{index}].tool_calls")
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None  # (checked in tools.py, naming tool_choice)
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        tools = self.tool_use
        if tools is not None and self.constraint is not None:
            # A forced call leaves no room for another grammar, and `auto` cannot hold a text
            # answer to a response_format; vLLM's extra-body constraints may shape an auto answer.
            if tools.enforced or self.constraint.field.startswith("response_format"):
                raise two_constraints("tool_choice" if tools.enforced else "tools", self.constraint.field)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets these "
                f"(reserved keys: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})",
                "chat_template_kwargs",
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )

    @functools.cached_property
    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool_choice, checked (tools.py)."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_parameters(self) -> dict[str, Any]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.common_sampling(max_tokens, logprobs)


class LoadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter (`model`: the Triton model, default --health-model)."""

    lora_name: str
    lora_path: str
    model: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter (vLLM also accepts a lora_int_id, which names nothing here)."""

    lora_name: str
    lora_int_id: int | None = None
    model: str | None = None


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    """The request body as `model`, or a 400 OpenAIError naming the offending field."""
    try:
        data = fast_json.loads(raw, parse_constant=_refuse_constant)
        # A lone surrogate ("\ud800") parses but cannot be encoded again: refuse it here, not
        # with a 500 when a prompt or an error message is encoded later. Only a \uD800-\uDFFF
        # escape or a surrogate's encoded bytes make one, so most UTF-8 bodies skip the walk
        # (json also reads UTF-16 and UTF-32 bodies, which the byte pattern would not see into).
        if json.detect_encoding(raw) != "utf-8" or _SURROGATE_ESCAPE.search(raw):
            if lone_surrogate_field(data) is not None:
                raise bad_request("the request body contains an unpaired UTF-16 surrogate")
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        raise bad_request(f"the request body is not valid JSON ({error})") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise _first_validation_error(error) from None
    body.check_unsupported()
    return body


# A \uD800-\uDFFF escape, or a surrogate's own 3 UTF-8 bytes (json.loads decodes with surrogatepass).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _first_validation_error(error: ValidationError) -> OpenAIError:
    first = error.errors(include_url=False)[0]
    location = _format_location(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {location}", location)
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{location}'", location)
    loc = tuple(first.get("loc", ()))
    branch = next((i for i, part in enumerate(loc) if _is_union_branch(part)), None)
    if branch is not None:  # the field holding the union, not where inside one member it failed
        location = _format_location(loc[:branch])
        return bad_request(f"Invalid type for '{location}': {_union_hint(location)}", location)
    message = first.get("msg", "invalid value")
    return bad_request(f"Invalid value for '{location}': {message}", location or None)


_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "none", "function-after", "function-before"})
_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "expected a string or a list of strings",
    "content": "expected a string or a list of content parts",
}


def _is_union_branch(part: Any) -> bool:
    return isinstance(part, str) and (part in _BRANCH_NAMES or "[" in part or part.startswith("function-"))


def _union_hint(location: str) -> str:
    return _UNION_HINTS.get(location.rsplit(".", 1)[-1], "none of the accepted types")


def _format_location(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union branch names are dropped."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and not _is_union_branch(part):
            text += f".{part}" if text else part
    return text
