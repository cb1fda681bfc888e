"""A request's output constraint (`structured_outputs`, vLLM's key): parsed here, without xgrammar or
torch, so the stub refuses a malformed constraint (unknown key, two kinds, a size over the cap,
JSON that does not parse) before the engine core sees it.

    {"json": {...schema...}}      the output is JSON valid under the schema (or the schema as JSON text)
    {"json_object": true}         the output is a JSON object
    {"regex": "..."}              the output matches the regular expression
    {"choice": ["a", "b"]}        the output is one of the strings
    {"grammar": "root ::= ..."}   the output is a sentence of the EBNF grammar (xgrammar's GBNF dialect)
    {"structural_tag": {...}}     xgrammar's structural tag (tool calls, reasoning blocks), object or text

plus the option `disable_any_whitespace` (true: JSON in its compact form; false: any whitespace
between tokens; absent: the server's `structured_output_whitespace`). vLLM's `disable_fallback`
and `disable_additional_properties` are accepted (there is one backend, and undeclared
properties are refused anyway), as is older clients' `backend` (ignored); `whitespace_pattern` is
refused.

A JSON schema must be valid JSON Schema (checked with `jsonschema`) and use only keywords the
grammar can enforce: a keyword xgrammar 0.2.9 would ignore (`not`, `uniqueItems`, `if`/`then`, ...)
would let invalid output through, so it is refused, naming the keyword's place in the schema.
`check_json_schema` does that where the schema compiles (structured_output/compile.py, in a
compile worker process; a cached schema is not checked again) and in the OpenAI server: checking
a 1 MB schema takes seconds of pure Python, which the stub's threads must not wait for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paged_llm.coercion import loads_request_json, parse_bool
from paged_llm.errors import InvalidRequestError

FIELD = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_OPTIONS = (
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
    "whitespace_pattern",
)
MAX_CHOICES = 4096

# Keywords the grammar enforces, or annotations that constrain nothing.
_ENFORCED = frozenset(
    {
        "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
        "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "unevaluatedProperties",
        "items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "additionalItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$anchor", "$comment",
        "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "discriminator",
        "nullable",
    }
)  # fmt: skip
# Keywords whose value is a schema, a list of schemas or a map of name -> schema.
_SUBSCHEMA = frozenset({"additionalProperties", "propertyNames", "unevaluatedProperties", "items",
                        "additionalItems", "unevaluatedItems"})  # fmt: skip
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
# Why each refused keyword is refused: the grammar would not hold the output to it.
_REFUSED = {
    "not": "negation cannot be enforced by the grammar",
    "if": "conditional schemas (if/then/else) cannot be enforced by the grammar",
    "then": "conditional schemas (if/then/else) cannot be enforced by the grammar",
    "else": "conditional schemas (if/then/else) cannot be enforced by the grammar",
    "uniqueItems": "unique array items cannot be enforced by the grammar",
    "contains": "'contains' cannot be enforced by the grammar",
    "minContains": "'minContains' cannot be enforced by the grammar",
    "maxContains": "'maxContains' cannot be enforced by the grammar",
    "dependentRequired": "dependencies between properties cannot be enforced by the grammar",
    "dependentSchemas": "dependencies between properties cannot be enforced by the grammar",
    "dependencies": "dependencies between properties cannot be enforced by the grammar",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "dynamic references are not supported",
}


@dataclass(frozen=True)
class StructuredOutputParams:
    """One request's constraint: what the engine core compiles (`kind`, `spec`) and how."""

    kind: str  # one of KINDS
    spec: str  # the text compiled: schema JSON, regex, EBNF (choices become EBNF), structural tag JSON
    any_whitespace: bool | None = None  # None: the server's setting

    @property
    def size_bytes(self) -> int:
        return len(self.spec.encode("utf-8"))


def parse_structured_outputs(
    raw: Any, max_bytes: int | None, field: str = FIELD
) -> StructuredOutputParams | None:
    """The constraint of a request's `structured_outputs` value (a mapping, or its JSON text); None
    when it asks for none (null, {} with only options, json_object false)."""
    if raw is None:
        return None
    if isinstance(raw, str | bytes):
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        raw = loads_request_json(text, field) if text.strip() else {}
    if not isinstance(raw, Mapping):
        raise InvalidRequestError(field, f"must be an object with one of: {', '.join(KINDS)}")
    unknown = [key for key in raw if key not in KINDS and key not in _OPTIONS]
    if unknown:
        raise InvalidRequestError(
            f"{field}.{unknown[0]}", f"unknown key (allowed: {', '.join(KINDS + _OPTIONS)})"
        )
    if raw.get("whitespace_pattern") not in (None, ""):
        raise InvalidRequestError(
            f"{field}.whitespace_pattern", "not supported; use disable_any_whitespace instead"
        )
    for option in ("disable_fallback", "disable_additional_properties"):
        if raw.get(option) is not None:
            parse_bool(f"{field}.{option}", raw[option])
    any_whitespace = None
    if raw.get("disable_any_whitespace") is not None:
        any_whitespace = not parse_bool(f"{field}.disable_any_whitespace", raw["disable_any_whitespace"])
    given = [kind for kind in KINDS if raw.get(kind) is not None]
    if given == ["json_object"] and not parse_bool(f"{field}.json_object", raw["json_object"]):
        return None
    if raw.get("backend") is not None and not isinstance(raw["backend"], str):
        raise InvalidRequestError(
            f"{field}.backend", "must be a string (it is ignored: the backend is xgrammar)"
        )
    if len(given) > 1:
        raise InvalidRequestError(
            field, f"give one constraint per request, got {len(given)}: {', '.join(given)}"
        )
    if not given:
        if any(raw.get(option) is not None for option in _OPTIONS if option != "backend"):
            raise InvalidRequestError(field, f"options without a constraint; give one of: {', '.join(KINDS)}")
        return None
    kind = given[0]
    spec = _SPEC_OF[kind](raw[kind], f"{field}.{kind}")
    params = StructuredOutputParams(kind, spec, any_whitespace)
    if max_bytes is not None and params.size_bytes > max_bytes:
        raise InvalidRequestError(
            f"{field}.{kind}",
            f"the constraint is {params.size_bytes} bytes, "
            f"over this server's max_grammar_bytes ({max_bytes})",
        )
    return params


def _json_spec(raw: Any, field: str) -> str:
    schema = loads_request_json(raw, field) if isinstance(raw, str) else raw
    if schema is True:
        schema = {}
    if schema is False:
        raise InvalidRequestError(field, "the schema false admits no output")
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(field, "must be a JSON Schema object (or its JSON text)")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _json_object_spec(raw: Any, field: str) -> str:
    return ""  # parse_structured_outputs read the flag


def _text_spec(raw: Any, field: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise InvalidRequestError(field, "must be a non-empty string")
    return raw


def _choice_spec(raw: Any, field: str) -> str:
    if not isinstance(raw, list | tuple) or not all(isinstance(item, str) for item in raw):
        raise InvalidRequestError(field, "must be a list of strings")
    if not raw:
        raise InvalidRequestError(field, "must list at least one choice")
    if len(raw) > MAX_CHOICES:
        raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(raw)}")
    return "root ::= " + " | ".join(_ebnf_literal(item) for item in dict.fromkeys(raw))


def _structural_tag_spec(raw: Any, field: str) -> str:
    tag = loads_request_json(raw, field) if isinstance(raw, str) else raw
    if not isinstance(tag, Mapping):
        raise InvalidRequestError(field, "must be an xgrammar structural tag object (or its JSON text)")
    return json.dumps(tag, ensure_ascii=False, separators=(",", ":"))


_SPEC_OF = {
    "json": _json_spec,
    "json_object": _json_object_spec,
    "regex": _text_spec,
    "choice": _choice_spec,
    "grammar": _text_spec,
    "structural_tag": _structural_tag_spec,
}


def _ebnf_literal(text: str) -> str:
    """`text` as a string literal of xgrammar's EBNF (quote, backslash and control characters escaped)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or char == "\x7f":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def check_json_schema(schema: Mapping[str, Any], field: str) -> None:
    """InvalidRequestError unless `schema` is valid JSON Schema (draft 2020-12) that the grammar
    enforces whole: the error names the offending place, e.g. `response_format.json_schema.schema`
    + `/properties/tags/uniqueItems`."""
    import jsonschema  # the stub imports this module for every request; schemas are rare

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        raise InvalidRequestError(
            f"{field}/{where}" if where else field, f"not a valid JSON Schema: {error.message}"
        ) from None
    except RecursionError:
        raise InvalidRequestError(field, "the schema is nested too deeply") from None
    try:
        _check_supported(schema, field)
    except RecursionError:
        raise InvalidRequestError(field, "the schema is nested too deeply") from None


def _check_supported(schema: Any, where: str) -> None:
    if not isinstance(schema, Mapping):
        return  # true / false schemas
    for key, value in schema.items():
        place = f"{where}/{key}"
        if key in _REFUSED:
            raise InvalidRequestError(place, f"unsupported JSON Schema keyword: {_REFUSED[key]}")
        if key == "oneOf" and "discriminator" not in schema:
            # Enforced as anyOf: an output may match two branches, which oneOf forbids. With a
            # discriminator (pydantic's tagged unions) the branches exclude each other.
            raise InvalidRequestError(
                place, "unsupported JSON Schema keyword: 'oneOf' without a discriminator (use anyOf)"
            )
        if key == "allOf" and not (isinstance(value, list) and len(value) == 1):
            raise InvalidRequestError(
                place, "unsupported JSON Schema keyword: 'allOf' with more than one schema"
            )
        if key not in _ENFORCED and key not in _ANNOTATIONS and key not in ("oneOf", "allOf"):
            raise InvalidRequestError(place, f"unsupported JSON Schema keyword {key!r}")
        if key in _SUBSCHEMA:
            _check_supported(value, place)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for index, item in enumerate(value):
                _check_supported(item, f"{place}/{index}")
        elif key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            for name, item in value.items():
                _check_supported(item, f"{place}/{name}")
