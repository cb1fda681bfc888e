"""JSON on the OpenAI server's hot path: orjson where it can, the standard library where it cannot.

A 512-token prompt's body takes json.loads ~40-75 us and the generate request's json.dumps ~45-60 us
on the 2-core VM; orjson ~12 and ~3. What orjson refuses (NaN / Infinity, a lone surrogate, UTF-16
bodies, nesting past 1024) goes to the standard library, so results and errors are the standard
library's; so does a text with a run of 19 or more digits (orjson reads an integer past 64 bits as
a float, where json keeps it an int).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

try:
    import orjson
except ImportError:  # (a pinned requirement; without it everything still works, slower)
    orjson = None  # type: ignore[assignment]


_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_LONG_DIGIT_RUN = b"0" * 19


def _has_long_digit_run(raw: bytes) -> bool:
    # (translate + find: ~3 us for a 512-id body, where a regex search takes ~50)
    return raw.translate(_DIGITS_AS_ZERO).find(_LONG_DIGIT_RUN) >= 0


def loads(raw: bytes | str, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """json.loads(raw, parse_constant=...), orjson first."""
    if orjson is not None and not _has_long_digit_run(raw if isinstance(raw, bytes) else raw.encode()):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library decides (and words the error)
    return json.loads(raw, parse_constant=parse_constant)


def dumps(value: Any) -> bytes:
    """UTF-8 JSON of plain data (str, int, bool, lists, dicts of str keys). Floats must be finite:
    orjson writes NaN as null."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:  # (orjson.JSONEncodeError) an int past 64 bits, a lone surrogate
            pass
    return json.dumps(value).encode()
