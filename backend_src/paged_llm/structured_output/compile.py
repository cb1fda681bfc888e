"""One constraint compiled by xgrammar: what a compile worker runs (compile_worker.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar

# xgrammar's C++ errors start with "[HH:MM:SS] /path/file.cc:123: ": the rest is for the client.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def compile_constraint(
    compiler: xgrammar.GrammarCompiler, kind: str, spec: str, any_whitespace: bool
) -> xgrammar.CompiledGrammar:
    """The compiled grammar of a StructuredOutputParams' kind and spec (structured_output_params.py)."""
    if kind == "json":
        schema = lower_string_lengths(json.loads(spec))
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False
        )
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind in ("choice", "grammar"):
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(json.dumps(_lower_tag_schemas(json.loads(spec))))
    raise ValueError(f"unknown constraint kind {kind!r}")


def error_text(error: BaseException) -> str:
    """A compile error's message, one line, without xgrammar's log prefix."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = _LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__
    return text[:500]


def lower_string_lengths(schema: Any) -> Any:
    """`schema` with every string's minLength/maxLength (and no pattern or format) written as a
    pattern of as many characters. xgrammar 0.2.9 lowers length bounds to a character class that
    admits raw control characters and no escapes (mlc-ai/xgrammar#800: a raw TAB inside a bounded
    string, which json.loads refuses); its pattern path builds JSON strings correctly."""
    if isinstance(schema, list):
        return [lower_string_lengths(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept = ("enum", "const", "default", "examples")  # values, not schemas
    lowered = {key: value if key in kept else lower_string_lengths(value) for key, value in schema.items()}
    bounded = isinstance(lowered.get("minLength", 0), int) and isinstance(lowered.get("maxLength", 0), int)
    bounded = bounded and ("minLength" in lowered or "maxLength" in lowered)
    if bounded and "pattern" not in lowered and "format" not in lowered and _may_be_string(lowered):
        low = int(lowered.pop("minLength", 0))
        high = lowered.pop("maxLength", None)
        lowered["pattern"] = f"^[\\s\\S]{{{low},{'' if high is None else int(high)}}}$"
    return lowered


def _lower_tag_schemas(node: Any) -> Any:
    """A structural tag with lower_string_lengths applied to each of its JSON schema parts (tool
    arguments, an answer after a reasoning block)."""
    if isinstance(node, list):
        return [_lower_tag_schemas(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {**node, "json_schema": lower_string_lengths(node["json_schema"])}
    return {key: _lower_tag_schemas(value) for key, value in node.items()}


def _may_be_string(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)
