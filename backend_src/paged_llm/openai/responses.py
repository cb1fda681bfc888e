"""OpenAI response bodies: completions and chat completions, whole or as SSE chunks, with logprobs
and usage. Choice `index` = prompt_index * n + sample index (OpenAI's order for several prompts)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from paged_llm.openai.triton_request import SequenceDelta

Position = dict[str, dict[str, Any]]  # {token_id: {logprob, rank, decoded_token}}, sampled token first


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def _sampled(position: Position) -> tuple[str, dict[str, Any]]:
    token_id = next(iter(position))
    return token_id, position[token_id]


def _top(position: Position, k: int) -> list[dict[str, Any]]:
    """The k most likely tokens of a position, most likely first."""
    entries = sorted(position.values(), key=lambda e: e["rank"])
    return [e for e in entries if e["rank"] <= k]


@dataclass
class CompletionLogprobs:
    """Completions' logprobs object, built up position by position."""

    k: int
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    _offset: int = 0

    def add(self, positions: list[Position]) -> dict[str, Any]:
        """Appends positions; returns the logprobs object of just these (for a stream chunk)."""
        part = CompletionLogprobs(self.k, _offset=self._offset)
        for position in positions:
            _, sampled = _sampled(position)
            token = sampled["decoded_token"]
            top = {e["decoded_token"]: e["logprob"] for e in _top(position, self.k)}
            top.setdefault(token, sampled["logprob"])  # OpenAI: the k most likely and the chosen one
            for target in (self, part):
                target.tokens.append(token)
                target.token_logprobs.append(sampled["logprob"])
                target.top_logprobs.append(top)
                target.text_offset.append(target._offset)
                target._offset += len(token)
        return part.as_dict()

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprobs(positions: list[Position], k: int) -> list[dict[str, Any]]:
    """Chat's logprobs.content entries."""
    content = []
    for position in positions:
        _, sampled = _sampled(position)
        content.append(
            {
                "token": sampled["decoded_token"],
                "logprob": sampled["logprob"],
                "bytes": list(sampled["decoded_token"].encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": e["decoded_token"],
                        "logprob": e["logprob"],
                        "bytes": list(e["decoded_token"].encode()),
                    }
                    for e in _top(position, k)
                ],
            }
        )
    return content


@dataclass
class Choice:
    """What one choice (prompt, sample) has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Position] = field(default_factory=list)
    started: bool = False  # chat streams: the role chunk went out

    def add(self, delta: SequenceDelta) -> None:
        self.text.append(delta.text)
        self.num_tokens = (
            delta.total_tokens if delta.total_tokens is not None else self.num_tokens + delta.num_tokens
        )
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


class ResponseBuilder:
    """Ids, timestamps and shapes common to both routes."""

    def __init__(self, kind: str, request_id: str, model: str, include_usage: bool = False) -> None:
        self.kind = kind  # "completion" | "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        # stream_options.include_usage: every chunk carries "usage" (null but in the last one), as OpenAI's do
        self.include_usage = include_usage
        self._prefix: str | None = None

    def _event_prefix(self) -> str:
        """`data: {"id":...,"choices":[{"index":` of this request's chunks, built once: a chunk per
        token is the hot path, and json.dumps of the whole dict costs several times more."""
        if self._prefix is None:
            envelope = json.dumps(self._envelope(chunk=True), ensure_ascii=False)
            self._prefix = f'data: {envelope[:-1]},"choices":[{{"index":'
        return self._prefix

    def text_event(self, index: int, text: str, finish_reason: str | None) -> bytes:
        """The SSE event of a chunk with new text and no logprobs (the common case), as
        completion_chunk / chat_chunk would build it."""
        reason = "null" if finish_reason is None else json.dumps(finish_reason)
        text_json = json.dumps(text, ensure_ascii=False)
        if self.kind == "chat":
            body = f'{index},"delta":{{"content":{text_json}}},"logprobs":null,"finish_reason":{reason}}}]}}'
        else:
            body = f'{index},"text":{text_json},"logprobs":null,"finish_reason":{reason}}}]}}'
        return f"{self._event_prefix()}{body}\n\n".encode()

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        envelope: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }
        if chunk and self.include_usage:
            envelope["usage"] = None
        return envelope

    # ------------------------------------------------------------------------------- whole responses
    def completion(
        self, choices: list[Choice], echo_texts: list[str], logprobs_k: int | None, usage_: dict[str, int]
    ) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        body["choices"] = []
        for choice in choices:
            logprobs = None
            if logprobs_k is not None:
                builder = CompletionLogprobs(logprobs_k)
                builder.add(choice.logprobs)
                logprobs = builder.as_dict()
            body["choices"].append(
                {
                    "index": choice.index,
                    "text": echo_texts[choice.index] + "".join(choice.text),
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }
            )
        body["usage"] = usage_
        return body

    def chat(self, choices: list[Choice], logprobs_k: int | None, usage_: dict[str, int]) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        body["choices"] = [
            {
                "index": choice.index,
                "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": {"content": chat_logprobs(choice.logprobs, logprobs_k)}
                if logprobs_k is not None
                else None,
                "finish_reason": choice.finish_reason,
            }
            for choice in choices
        ]
        body["usage"] = usage_
        return body

    # ------------------------------------------------------------------------------------ chunks
    def completion_chunk(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
        return body

    def chat_chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: list[dict[str, Any]] | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = [
            {
                "index": index,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish_reason,
            }
        ]
        return body

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = usage_
        return body
