"""Client values coerced to int / float / bool and client JSON parsed, every failure an InvalidRequestError.

Clients send numbers and flags as JSON whose values may be strings ("0.7", "true"), as genai-perf
does, and config.pbtxt's parameters are all strings: both go through these coercers, so a bad value is
refused in the same words wherever it came in. No range checks here (sampling_params.py and config.py
know the ranges).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from paged_llm.errors import InvalidRequestError

# A \uD800-\uDFFF escape: JSON allows it alone, Unicode does not (such text cannot be encoded).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads_request_json(text: str, field_name: str) -> Any:
    """json.loads for client input: every way it can fail (bad syntax, nesting deep enough to hit the
    recursion limit, an integer past Python's digit limit) is an InvalidRequestError naming the field,
    with a one-line message."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(field_name, "invalid JSON: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, and int("9" * 5000)'s digit limit
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise InvalidRequestError(field_name, f"invalid JSON: {message}") from None
    if _SURROGATE_ESCAPE.search(text):  # json.loads joins a pair; a lone one stays and breaks later
        try:
            where = lone_surrogate_field(value)
        except RecursionError:
            raise InvalidRequestError(field_name, "invalid JSON: nested too deeply") from None
        if where is not None:
            raise InvalidRequestError(
                where or field_name, "not valid Unicode: a \\ud800-\\udfff escape without its pair"
            )
    return value


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_field(value: Any) -> str | None:
    """None if `value` holds no lone surrogate; else the top-level key it is under ("" when that
    key itself holds one, or `value` is not an object)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if has_lone_surrogate(key):
                return ""
            if lone_surrogate_field(item) is not None:
                return key
        return None
    if isinstance(value, list):
        return "" if any(lone_surrogate_field(item) is not None for item in value) else None
    return "" if isinstance(value, str) and has_lone_surrogate(value) else None


def parse_int(name: str, raw: Any) -> int:
    if isinstance(raw, bool):
        raise InvalidRequestError(name, f"must be an integer, got a boolean ({raw})")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and math.isfinite(raw) and raw == int(raw):
        value = int(raw)
    elif isinstance(raw, str):
        try:
            value = int(raw.strip())
        except ValueError:
            try:
                as_float = float(raw.strip())
            except ValueError:
                raise InvalidRequestError(name, f"must be an integer, got {raw!r}") from None
            if not math.isfinite(as_float) or as_float != int(as_float):
                raise InvalidRequestError(name, f"must be an integer, got {raw!r}") from None
            value = int(as_float)
    else:
        raise InvalidRequestError(name, f"must be an integer, got {type(raw).__name__}")
    if abs(value) >= 1 << 64:
        raise InvalidRequestError(name, f"must fit in 64 bits, got {value}")
    return value


def parse_float(name: str, raw: Any) -> float:
    if isinstance(raw, bool):
        raise InvalidRequestError(name, f"must be a number, got a boolean ({raw})")
    if isinstance(raw, int | float):
        try:
            value = float(raw)
        except OverflowError:  # an integer of more than 308 digits
            message = "must be a finite number, got an integer past float's range"
            raise InvalidRequestError(name, message) from None
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise InvalidRequestError(name, f"must be a number, got {raw!r}") from None
    else:
        raise InvalidRequestError(name, f"must be a number, got {type(raw).__name__}")
    if not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {raw!r}")
    return value


def parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false", "1", "0"):
        return raw.strip().lower() in ("true", "1")
    raise InvalidRequestError(name, f"must be a boolean (true/false), got {raw!r}")
