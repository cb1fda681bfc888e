"""SamplingParams, the server's RequestLimits, and their validation: the only place user-controlled
sampling numbers are range-checked.

Every field is coerced from int/float/bool/str (coercion.py: clients such as genai-perf send "0.7" or
"true") and then range-checked. Every failure is an `InvalidRequestError` naming the field and the
allowed range; unknown keys are errors, never ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from paged_llm.coercion import loads_request_json, parse_bool, parse_float, parse_int
from paged_llm.errors import InvalidRequestError
from paged_llm.structured_output_params import StructuredOutputParams, parse_structured_outputs

_UINT64_MASK = (1 << 64) - 1
# As in vLLM, temperatures this small are treated as greedy (dividing by them would overflow float32).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
# The sampler computes in float32: a value past its range would become inf or 0 there, and
# -inf / inf (a suppressed logit) is NaN, which wins every argmax.
FLOAT32_MAX = 3.4028234663852886e38
# A positive logit is divided by the repetition penalty: below this, ordinary logits reach inf.
MIN_REPETITION_PENALTY = 1e-6
# Filled by the stub (it has the tokenizer), never sent by clients.
_INTERNAL_FIELDS = frozenset({"extra", "bad_words_token_ids"})


MAX_LORA_NAME_CHARS = 256  # a LoRA adapter's name (lora_name, lora_modules)


@dataclass(frozen=True)
class RequestLimits:
    """Server-side caps on what one request may ask for (from config.pbtxt)."""

    max_n: int = 16
    max_logprobs: int = 20
    max_tokens: int | None = None  # None: bounded only by max_model_len
    max_priority_abs: int = 1 << 31
    max_prompt_bytes: int | None = 1 << 20  # text_input larger than this is refused (None: no cap)
    # A structured output constraint (schema, regex, grammar, ...) larger than this is refused.
    max_grammar_bytes: int | None = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # parallel samples of the same prompt
    max_tokens: int | None = 16  # None: until max_model_len (vLLM's default is 16)
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many were generated
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens seen in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # fixes this request's randomness regardless of batch composition
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per position; 0 = only the sampled token
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs sooner
    # vLLM's bad_words: none of these words is generated. Each is tokenized with and without a leading
    # space; whenever the output ends with all but the last token of one, that last token is banned.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # their tokenizations (the stub)
    # Speculative decoding for this request where the server has it on (false: one token per step).
    speculative_decoding: bool = True
    # The output is held to a grammar (JSON schema, regex, choice, EBNF, structural tag):
    # structured_output_params.py; the engine core compiles it (structured_output/).
    structured_outputs: StructuredOutputParams | None = None
    # The LoRA adapter this request runs with (a name the server loaded: lora_modules); None: the
    # base model. vllm_backend's key in sampling_parameters; the OpenAI server sets it from `model`.
    lora_name: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def has_penalties(self) -> bool:
        """A repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def needs_output_history(self) -> bool:
        """Sampling reads the values of the tokens generated so far (penalties, bad words): the next
        token cannot be sampled before the previous one is on the host (no asynchronous scheduling)."""
        return self.has_penalties or bool(self.bad_words_token_ids)

    @functools.cached_property
    def is_greedy_under_grammar(self) -> bool:
        """Greedy with nothing but a grammar (if any) that changes or reports the logits: an argmax
        of the grammar-masked logits decides the token."""
        return (
            self.temperature < GREEDY_TEMPERATURE_EPS
            and not self.needs_output_history
            and self.logprobs is None
        )

    @staticmethod
    def from_json(text: str | bytes, limits: RequestLimits | None = None) -> SamplingParams:
        return SamplingParams.from_fields(SamplingParams.parse_fields(text, limits), limits)

    @staticmethod
    def from_mapping(payload: Mapping[str, Any], limits: RequestLimits | None = None) -> SamplingParams:
        return SamplingParams.from_fields(SamplingParams.parse_fields(payload, limits), limits)

    @staticmethod
    def parse_fields(
        source: str | bytes | Mapping[str, Any], limits: RequestLimits | None = None
    ) -> dict[str, Any]:
        """A client's sampling parameters (JSON text or a mapping) coerced to field values, not yet
        range-checked: a caller that fills a default of its own (the Triton codec's logprobs) does
        so here, and `from_fields` builds and validates the params once."""
        payload = _json_payload(source) if isinstance(source, str | bytes) else source
        limits = limits or RequestLimits()
        known = {f.name for f in fields(SamplingParams)} - _INTERNAL_FIELDS
        values: dict[str, Any] = {}
        for key, raw in payload.items():
            if key in _STRUCTURED_OUTPUT_KEYS:
                if "structured_outputs" in payload and "guided_decoding" in payload:
                    raise InvalidRequestError(key, "give structured_outputs or guided_decoding, not both")
                values["structured_outputs"] = parse_structured_outputs(raw, limits.max_grammar_bytes, key)
                continue
            if key in _COMPAT_KEYS:
                _COMPAT_KEYS[key](raw, payload)
                continue
            if key not in known:
                allowed = ", ".join(sorted(known))
                raise InvalidRequestError(key, f"unknown sampling parameter (allowed: {allowed})")
            if raw is None and key == "max_tokens":
                # As in vLLM: until max_model_len (the engine core bounds it by max_tokens_cap too,
                # once it knows the prompt with a session's history: EngineCore.add_request).
                values[key] = None
                continue
            if raw is None and key in _NULLABLE:
                continue  # null means "use the default", as in vLLM
            if key == "logprobs" and (isinstance(raw, bool) or str(raw).lower() in ("true", "false")):
                # OpenAI-style clients send a boolean: false = none, true = the sampled token's only
                if parse_bool(key, raw):
                    values[key] = 0
                continue
            values[key] = _PARSERS[key](key, raw)
        if "max_tokens" not in values and limits.max_tokens is not None:
            # The default (16) within a smaller server cap: a request that did not ask is not refused.
            values["max_tokens"] = min(limits.max_tokens, SamplingParams.max_tokens or limits.max_tokens)
        return values

    @staticmethod
    def from_fields(values: Mapping[str, Any], limits: RequestLimits | None = None) -> SamplingParams:
        """The params of `parse_fields`' values, range-checked against `limits`."""
        params = SamplingParams(**values)
        params.validate(limits or RequestLimits())
        return params

    def validate(self, limits: RequestLimits) -> None:
        _check_range("n", self.n, 1, limits.max_n)
        if self.max_tokens is not None:
            upper = limits.max_tokens if limits.max_tokens is not None else None
            _check_range("max_tokens", self.max_tokens, 1, upper)
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_range("temperature", self.temperature, 0.0, FLOAT32_MAX)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= FLOAT32_MAX:
            raise InvalidRequestError(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY}, {FLOAT32_MAX:.4g}] (1 = off), "
                f"got {self.repetition_penalty}",
            )
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, limits.max_logprobs)
        _check_range("priority", self.priority, -limits.max_priority_abs, limits.max_priority_abs)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for text in self.stop:
            if not text or len(text) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    "stop", f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for token_id in self.stop_token_ids:
            _check_range("stop_token_ids", token_id, 0, None)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError(
                "bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}"
            )
        for text in self.bad_words:
            if not text.strip() or len(text) > MAX_BAD_WORD_CHARS:
                raise InvalidRequestError(
                    "bad_words", f"each word must have 1..{MAX_BAD_WORD_CHARS} characters, not only spaces"
                )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks what depends on the model (the engine calls it once it knows the vocabulary)."""
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )


def _json_payload(text: str | bytes) -> Mapping[str, Any]:
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError("sampling_parameters", f"not valid UTF-8 ({error})") from None
    if not text.strip():
        return {}
    payload = loads_request_json(text, "sampling_parameters")
    if not isinstance(payload, dict):
        raise InvalidRequestError("sampling_parameters", "must be a JSON object")
    return payload


def _check_range(name: str, value: float, lower: float | None, upper: float | None) -> None:
    if (lower is not None and value < lower) or (upper is not None and value > upper):
        low = "-inf" if lower is None else lower
        high = "inf" if upper is None else upper
        raise InvalidRequestError(name, f"must be in [{low}, {high}], got {value}")


def _parse_seed(name: str, raw: Any) -> int:
    # Any 64-bit value (signed or unsigned) is a valid seed; it is used modulo 2**64.
    return parse_int(name, raw) & _UINT64_MASK


def _parse_stop(name: str, raw: Any) -> tuple[str, ...]:
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return tuple(raw)
    raise InvalidRequestError(name, "must be a string or a list of strings")


def _parse_token_ids(name: str, raw: Any) -> tuple[int, ...]:
    if isinstance(raw, list | tuple):
        return tuple(parse_int(name, item) for item in raw)
    if isinstance(raw, int | str) and not isinstance(raw, bool):
        return (parse_int(name, raw),)
    raise InvalidRequestError(name, "must be a list of token ids")


def _parse_lora_name(name: str, raw: Any) -> str | None:
    if not isinstance(raw, str):
        raise InvalidRequestError(name, f"must be a string (an adapter's name), got {type(raw).__name__}")
    if len(raw) > MAX_LORA_NAME_CHARS:
        raise InvalidRequestError(name, f"at most {MAX_LORA_NAME_CHARS} characters")
    return raw or None  # "": the base model, as vllm_backend's client sends without -l


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "lora_name": _parse_lora_name,
    "n": parse_int,
    "max_tokens": parse_int,
    "min_tokens": parse_int,
    "temperature": parse_float,
    "top_p": parse_float,
    "top_k": parse_int,
    "min_p": parse_float,
    "repetition_penalty": parse_float,
    "presence_penalty": parse_float,
    "frequency_penalty": parse_float,
    "seed": _parse_seed,
    "stop": _parse_stop,
    "bad_words": _parse_stop,
    "stop_token_ids": _parse_token_ids,
    "include_stop_str_in_output": parse_bool,
    "ignore_eos": parse_bool,
    "logprobs": parse_int,
    "skip_special_tokens": parse_bool,
    "priority": parse_int,
    "speculative_decoding": parse_bool,
}
# vLLM's key, and the name older vLLM releases (and clients written for them) gave the same object.
_STRUCTURED_OUTPUT_KEYS = ("structured_outputs", "guided_decoding")
_NULLABLE = {"seed", "logprobs", "stop", "stop_token_ids", "bad_words", "lora_name"}


def _compat_best_of(raw: Any, payload: Mapping[str, Any]) -> None:
    # vLLM clients send best_of; only best_of == n (no extra candidates) is meaningful here.
    if raw is None:
        return
    best_of = parse_int("best_of", raw)
    n = parse_int("n", payload.get("n", 1))
    if best_of != n:
        raise InvalidRequestError("best_of", f"only best_of == n is supported (n={n}), got {best_of}")


def _compat_use_beam_search(raw: Any, payload: Mapping[str, Any]) -> None:
    if parse_bool("use_beam_search", raw):
        raise InvalidRequestError("use_beam_search", "beam search is not supported; only false is allowed")


# Keys vLLM clients commonly send that are accepted only with their no-op values.
_COMPAT_KEYS: dict[str, Callable[[Any, Mapping[str, Any]], None]] = {
    "best_of": _compat_best_of,
    "use_beam_search": _compat_use_beam_search,
}
