"""A reasoning model's `<think>...</think>` block split from its answer, as vLLM's
`--reasoning-parser` names them:

  qwen3        Qwen3: the model opens <think> itself (reasoning only if the output starts with it);
               with a template that opens it in the prompt (Qwen3-Thinking-2507, Qwen3.5) the output
               starts inside it
  deepseek_r1  DeepSeek-R1: the template opens <think> in the prompt, so the output starts inside
               the reasoning (a <think> the model writes again is dropped)

Where the output starts is read from the rendered prompt's end (`prompt_think_state`): a prompt that
already closed the block (Qwen3's template with enable_thinking false renders `<think>\\n\\n</think>\\n\\n`)
makes the whole output content. Inside the block, the text before `</think>` is reasoning and the
rest content; a block the output never closes (cut by max_tokens) is all reasoning, as vLLM has it
since it streams reasoning as it comes: a streamed reasoning delta cannot be taken back.

Fed piece by piece or whole, a splitter returns the same parts (output_parts.py); it holds back only
what may be the start of a `<think>` or `</think>` tag.
"""

from __future__ import annotations

from typing import Literal

from paged_llm.openai.json_scan import partial_suffix
from paged_llm.openai.output_parts import Part, content

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")
PromptThinkState = Literal["open", "closed", "none"]


def prompt_think_state(prompt: str) -> PromptThinkState:
    """Whether the rendered prompt ends inside a reasoning block ("open"), right after one
    ("closed"), or neither."""
    tail = prompt[-64:].rstrip()  # (not a copy of a long prompt)
    if tail.endswith(THINK_OPEN):
        return "open"
    if tail.endswith(THINK_CLOSE):
        return "closed"
    return "none"


def starts_in_reasoning(parser: str, state: PromptThinkState) -> bool | None:
    """True: the output starts inside the reasoning block; None: it does if it opens with <think>
    (qwen3 after a prompt that did not open one); False: no reasoning (the prompt closed the block)."""
    if state == "closed":
        return False
    if parser == "deepseek_r1" or state == "open":
        return True
    return None


class ReasoningSplitter:
    """One choice's text, fed piece by piece (`feed`, then `finish`), as reasoning and content parts."""

    def __init__(self, parser: str, state: PromptThinkState) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        inside = starts_in_reasoning(parser, state)
        # opening: inside the block, a <think> the model writes first is dropped;
        # maybe: reasoning only if the output opens with <think>
        self._state = "content" if inside is False else "opening" if inside else "maybe"
        self._buffer = ""

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Part]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            buffer = self._buffer
            if self._state == "content":
                self._buffer = ""
                return out + content(buffer)
            if self._state in ("opening", "maybe"):
                if buffer.startswith(THINK_OPEN):
                    self._buffer = buffer[len(THINK_OPEN) :]
                    self._state = "reasoning"
                elif not final and THINK_OPEN.startswith(buffer):
                    return out
                else:
                    self._state = "reasoning" if self._state == "opening" else "content"
                continue
            at = buffer.find(THINK_CLOSE)
            if at >= 0:
                out.extend([Part("reasoning", buffer[:at])] if at else [])
                self._buffer = buffer[at + len(THINK_CLOSE) :]
                self._state = "content"
                continue
            keep = 0 if final else partial_suffix(buffer, THINK_CLOSE)
            if len(buffer) > keep:
                out.append(Part("reasoning", buffer[: len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep :]
            return out
