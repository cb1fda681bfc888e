"""Tool calls read out of a model's text, as vLLM's `--tool-call-parser` names them:

  hermes       Qwen2.5 / Qwen3 (Hermes style): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>,
               one or more, text around them is content
  llama3_json  Llama 3.1 / 3.2: the output is {"name": ..., "parameters": {...}}, several separated
               by "; ", optionally after <|python_tag|>; output that does not start so is content

A parser is fed the text as it streams and returns Parts (output_parts.py); fed the whole text at
once it returns the same parts, so streamed deltas always reassemble to the non-streamed message. A
call whose head `{"name": "...", "arguments": ` is in canonical order starts as soon as its name is
known, and its arguments stream as the model writes them, compact (whitespace outside strings
dropped, as OpenAI's arguments are); one written in another order is parsed when it is complete
and its arguments serialized compact. Only text that may
still become a tag is held back, and whitespace until what follows it is known (whitespace before a
call, between calls and after the last one is dropped).

`CallFormat` is how each format writes one call: structural_tags.py builds the grammar of
`tool_choice` required / named from it, so the grammar produces exactly what the parser reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paged_llm.openai.json_scan import (
    NEED_MORE,
    ValueScanner,
    call_head,
    partial_suffix,
    skip_whitespace,
)
from paged_llm.openai.output_parts import Part

_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class CallFormat:
    """How a format writes a call: `head_prefix` + the name as a JSON string + `head_suffix`, the
    arguments object, `end`; several calls joined by `separator`."""

    head_prefix: str
    head_suffix: str
    end: str
    separator: str

    def begin(self, name: str) -> str:
        return f"{self.head_prefix}{json.dumps(name, ensure_ascii=False)}{self.head_suffix}"


def whole_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object written in any key order, or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = value.get("arguments", value.get("parameters", {}))
    # (A model that wrote the arguments as a JSON string already wrote what OpenAI sends.)
    if isinstance(arguments, str):
        return value["name"], arguments
    text_arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return value["name"], text_arguments


class ToolCallParser:
    """The text of one choice, fed piece by piece (`feed`, then `finish`), as Parts."""

    name = ""
    call_format: CallFormat
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self.num_calls = 0
        self._buffer = ""  # text received and not yet turned into parts

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Part]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Part]:
        raise NotImplementedError

    def _start_call(self, name: str, out: list[Part]) -> int:
        index = self.num_calls
        self.num_calls += 1
        out.append(Part("call", name, index))
        return index

    def _whole_call(self, name: str, arguments: str, out: list[Part]) -> None:
        index = self._start_call(name, out)
        if arguments:
            out.append(Part("arguments", arguments, index))


class HermesParser(ToolCallParser):
    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    call_format = CallFormat('<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n")

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"
        self._held = ""  # whitespace whose fate depends on what follows it
        self._scanner = ValueScanner()
        self._index = -1

    def _run(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            buffer = self._buffer
            if self._state == "text":
                at = buffer.find(self.OPEN)
                if at >= 0:
                    self._text(buffer[:at], out)
                    self._held = ""  # whitespace before a call is dropped
                    self._buffer = buffer[at + len(self.OPEN) :]
                    self._state = "head"
                    continue
                keep = 0 if final else partial_suffix(buffer, self.OPEN)
                self._text(buffer[: len(buffer) - keep], out)
                self._buffer = buffer[len(buffer) - keep :]
                if final and self.num_calls == 0:
                    out.extend([Part("content", self._held)] if self._held else [])
                if final:
                    self._held = ""
                return out
            if self._state == "head":
                end, name = call_head(buffer, 0, self.argument_keys)
                if end >= 0:
                    self._index = self._start_call(name, out)
                    self._buffer = buffer[end:]
                    self._scanner = ValueScanner()
                    self._state = "arguments"
                    continue
                if end == NEED_MORE and not final:
                    return out
                self._state = "raw"
                continue
            if self._state == "raw":  # a call in another key order, or not a call at all
                at = buffer.find(self.CLOSE)
                if at < 0 and not final:
                    return out
                body = buffer if at < 0 else buffer[:at]
                call = whole_call(body)
                if call is not None:
                    self._whole_call(*call, out)
                else:
                    self._text(self.OPEN + body + ("" if at < 0 else self.CLOSE), out)
                self._buffer = "" if at < 0 else buffer[at + len(self.CLOSE) :]
                self._state = "text"
                continue
            if self._state == "arguments":
                piece, end = self._scanner.advance(buffer, 0)
                if piece:
                    out.append(Part("arguments", piece, self._index))
                self._buffer = buffer[end:]
                if self._scanner.done:
                    self._state = "after_call"
                    continue
                return out
            # after_call: the rest of the call object, up to the closing tag, is dropped
            at = buffer.find(self.CLOSE)
            if at >= 0:
                self._buffer = buffer[at + len(self.CLOSE) :]
                self._state = "text"
                continue
            self._buffer = "" if final else buffer[len(buffer) - partial_suffix(buffer, self.CLOSE) :]
            return out

    def _text(self, text: str, out: list[Part]) -> None:
        if not text:
            return
        text = self._held + text
        kept = text.rstrip(_WHITESPACE)
        self._held = text[len(kept) :]
        if kept:
            out.append(Part("content", kept))


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    call_format = CallFormat('{"name": ', ', "parameters": ', "}", "; ")
    argument_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        self._lead = ""  # consumed text that becomes content if no call follows it
        self._scanner = ValueScanner()
        self._scanned = 0  # (raw) how far the scanner has read the buffer
        self._index = -1

    def _run(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            buffer = self._buffer
            if self._state == "content":
                self._content(buffer, out)
                self._buffer = ""
                return out
            if self._state == "start":
                pos = skip_whitespace(buffer, 0)
                rest = buffer[pos:]
                if rest.startswith(self.PYTHON_TAG):
                    self._lead, self._buffer = (
                        buffer[: pos + len(self.PYTHON_TAG)],
                        rest[len(self.PYTHON_TAG) :],
                    )
                    self._state = "call"
                elif rest.startswith("{"):
                    self._lead, self._buffer = buffer[:pos], rest
                    self._state = "call"
                elif not final and self.PYTHON_TAG.startswith(rest):
                    return out
                else:
                    self._state = "content"
                continue
            if self._state == "call":
                end, name = call_head(buffer, 0, self.argument_keys)
                if end >= 0:
                    self._lead = ""
                    self._index = self._start_call(name, out)
                    self._buffer = buffer[end:]
                    self._scanner = ValueScanner()
                    self._state = "arguments"
                    continue
                if end == NEED_MORE and not final:
                    return out
                pos = skip_whitespace(buffer, 0)
                if final and pos == len(buffer) and self.num_calls:
                    self._buffer = self._lead = ""  # a separator the output ended after
                    return out
                if not buffer.startswith("{", pos):
                    self._buffer = self._lead + buffer
                    self._state = "content"
                    continue
                self._scanner, self._scanned = ValueScanner(), 0
                self._state = "raw"
                continue
            if self._state == "raw":  # an object whose head is not a call's in canonical order
                _, self._scanned = self._scanner.advance(buffer, self._scanned)
                if not self._scanner.done and not final:
                    return out
                body = buffer[: self._scanned]
                call = whole_call(body) if self._scanner.done else None
                if call is None:
                    self._buffer = self._lead + buffer
                    self._state = "content"
                    continue
                self._lead = ""
                self._whole_call(*call, out)
                self._buffer = buffer[self._scanned :]
                self._state = "between"
                continue
            if self._state == "arguments":
                piece, end = self._scanner.advance(buffer, 0)
                if piece:
                    out.append(Part("arguments", piece, self._index))
                self._buffer = buffer[end:]
                if not self._scanner.done:
                    return out
                self._scanner = ValueScanner(depth=1)  # the rest of the call object
                self._state = "object_end"
                continue
            if self._state == "object_end":
                _, end = self._scanner.advance(buffer, 0)
                self._buffer = buffer[end:]
                if not self._scanner.done:
                    return out
                self._state = "between"
                continue
            # between: "; " and the next call, or the end; anything else is content
            pos = skip_whitespace(buffer, 0)
            if pos == len(buffer):
                if final:
                    self._buffer = ""
                return out
            if buffer[pos] == ";":
                self._lead, self._buffer = buffer[: pos + 1], buffer[pos + 1 :]
                self._state = "call"
            else:
                self._buffer = buffer[pos:]
                self._state = "content"

    @staticmethod
    def _content(text: str, out: list[Part]) -> None:
        if text:
            out.append(Part("content", text))


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}
