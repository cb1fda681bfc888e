"""One constraint compiled by xgrammar: what a compile worker runs (compile_worker.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar

from paged_llm.errors import InvalidRequestError
from paged_llm.structured_output_params import FIELD, check_json_schema

# xgrammar's C++ errors start with "[HH:MM:SS] /path/file.cc:123: ": the rest is for the client.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# xgrammar 0.2.9 builds a string with minLength/maxLength from this character class, which admits
# raw control characters (mlc-ai/xgrammar#800: a raw TAB inside a bounded string, which JSON
# forbids and json.loads refuses); the unbounded strings' class excludes them. The grammar goes
# through its EBNF text with the class mended. (Escapes stay unreachable in bounded strings, as
# in xgrammar; the output is valid JSON either way.) Writing the bounds as a pattern instead
# compiled 30x slower: a 10-property schema took 1.5 s.
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_JSON_STRING_CLASS = r"[^\0-\x1f\"\\\r\n]"
# xgrammar 0.2.9 prints a code point 0x80-0xFF as \xHH but parses a \x escape with every hex digit
# that follows: "acbéa" in a JSON schema's enum came back from its EBNF text as "acb\u0e9a" ("acbບ"),
# a string the schema refuses, and a model wrote it. 4-digit \u escapes parse exactly.
_HEX_BYTE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def _exact_escapes(ebnf: str) -> str:
    """`ebnf` with each \\xHH escape (not an escaped backslash followed by "x") written \\u00HH."""
    return _HEX_BYTE_ESCAPE.sub(r"\1\\u00\2", ebnf)


def compile_constraint(
    compiler: xgrammar.GrammarCompiler, kind: str, spec: str, any_whitespace: bool
) -> xgrammar.CompiledGrammar:
    """The compiled grammar of a StructuredOutputParams' kind and spec (structured_output_params.py)."""
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind in ("choice", "grammar"):
        return compiler.compile_grammar(spec)
    if kind == "json":
        check_json_schema(json.loads(spec), f"{FIELD}.json")
        grammar = xgrammar.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
    elif kind == "json_object":
        grammar = xgrammar.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False
        )
    elif kind == "structural_tag":
        _check_tag_schemas(json.loads(spec), f"{FIELD}.structural_tag")
        grammar = xgrammar.Grammar.from_structural_tag(spec)
    else:
        raise ValueError(f"unknown constraint kind {kind!r}")
    ebnf = _exact_escapes(str(grammar)).replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS)
    return compiler.compile_grammar(ebnf)


def attempt_compile(
    compiler: xgrammar.GrammarCompiler, kind: str, spec: str, any_whitespace: bool
) -> tuple[xgrammar.CompiledGrammar | None, str | None, str | None]:
    """(the grammar, None, None), or (None, the client's error, where in the constraint or None):
    a constraint that does not compile is its request's error, never the compiler's."""
    try:
        return compile_constraint(compiler, kind, spec, any_whitespace), None, None
    except InvalidRequestError as error:  # a schema the grammar cannot enforce: where, and why
        return None, str(error).removeprefix(f"{error.field}: "), error.field
    except Exception as error:  # xgrammar's parse or compile error
        return None, error_text(error), None


def _check_tag_schemas(node: Any, where: str) -> None:
    """check_json_schema for each JSON schema part of a structural tag (tool arguments, ...)."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            _check_tag_schemas(item, f"{where}/{index}")
    elif isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            check_json_schema(node["json_schema"], f"{where}/json_schema")
        for key, value in node.items():
            if key != "json_schema":
                _check_tag_schemas(value, f"{where}/{key}")


def error_text(error: BaseException) -> str:
    """A compile error's message, one line, without xgrammar's log prefix."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = _LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__
    return text[:500]
