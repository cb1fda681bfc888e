"""Reading JSON as it streams in, for the tool-call parsers (tool_parsers.py): where a call's head
`{"name": "...", "arguments": ` ends, and where a JSON value ends, decided from the text seen so far
and never revised by what comes later (so a stream cut anywhere parses as the whole text does).
"""

from __future__ import annotations

import json

NEED_MORE = -1  # the text ends before the answer is known
FAIL = -2  # the text cannot be what was looked for, whatever follows
_WHITESPACE = " \t\r\n"


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (what must be held
    back: the tag may be completing)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _literal(text: str, pos: int, literal: str) -> int:
    end = pos + len(literal)
    if text.startswith(literal, pos):
        return end
    return NEED_MORE if literal.startswith(text[pos:]) else FAIL


def string_end(text: str, pos: int) -> int:
    """The index after the JSON string that opens at `pos` (a quote), NEED_MORE or FAIL."""
    if pos >= len(text):
        return NEED_MORE
    if text[pos] != '"':
        return FAIL
    index = pos + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        if char < " ":  # a raw control character: not JSON
            return FAIL
        index += 1
    return NEED_MORE


def call_head(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[int, str]:
    """Matches `{"name": "NAME", "KEY": ` at `pos` (any whitespace between, KEY one of
    `argument_keys`): (the index after the colon, NAME), or (NEED_MORE | FAIL, "")."""
    steps: list[tuple[str, ...]] = [("{",), ('"name"',), (":",), ("string",), (",",), argument_keys, (":",)]
    name = ""
    for step in steps:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return NEED_MORE, ""
        if step == ("string",):
            end = string_end(text, pos)
            if end < 0:
                return end, ""
            try:
                name = json.loads(text[pos:end])
            except ValueError:  # a bad escape
                return FAIL, ""
            pos = end
            continue
        candidates = [f'"{key}"' for key in step] if step is argument_keys else list(step)
        results = [_literal(text, pos, literal) for literal in candidates]
        matched = [end for end in results if end >= 0]
        if matched:
            pos = matched[0]
        elif NEED_MORE in results:
            return NEED_MORE, ""
        else:
            return FAIL, ""
    return pos, name


class ValueScanner:
    """Finds where one JSON value ends, text piece by piece, and gives its text compact: whitespace
    outside strings dropped (a grammar lets a model put blanks there; OpenAI's arguments have
    none). Enough to delimit a well-formed value (it tracks strings and nesting); it does not
    validate one."""

    def __init__(self, depth: int = 0) -> None:
        # depth > 0: the scan starts inside that many open objects or arrays (the rest of one)
        self.depth = depth
        self.started = depth > 0
        self.primitive = False
        self.in_string = False
        self.escape = False
        self.done = False

    def advance(self, text: str, pos: int) -> tuple[str, int]:
        """Scans `text[pos:]`: (the value's characters in it, compact; the index where they end).
        Once the value is complete, `done` is set and the end is the index after its last character."""
        if not self.started:
            pos = skip_whitespace(text, pos)
            if pos >= len(text):
                return "", pos
            self.started = True
            self.primitive = text[pos] not in '{["'
        pieces: list[str] = []
        start = index = pos
        while index < len(text):
            char = text[index]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return _joined(pieces, text[start : index + 1]), index + 1
            elif self.primitive:
                if char in _WHITESPACE or char in ",}]:;<":
                    self.done = True
                    return _joined(pieces, text[start:index]), index
            elif char in _WHITESPACE:
                pieces.append(text[start:index])
                start = index + 1
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return _joined(pieces, text[start : index + 1]), index + 1
            elif char == "<":  # outside a string, never JSON: a tag follows an unclosed value
                self.done = True
                return _joined(pieces, text[start:index]), index
            index += 1
        return _joined(pieces, text[start:index]), index


def _joined(pieces: list[str], last: str) -> str:
    return "".join(pieces) + last if pieces else last
