"""One OpenAI request in flight: its Triton streams merged, and what its choices produced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from paged_llm.openai.responses import Choice, usage
from paged_llm.openai.triton_client import TritonClient
from paged_llm.openai.triton_request import GenerationChunk, GenerationRequest


class _Done:
    pass


async def merge_streams(
    backend: TritonClient, requests: list[GenerationRequest]
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """The chunks of several requests as they come, tagged with the request's position."""
    if len(requests) == 1:
        async with aclosing(backend.generate(requests[0])) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk | None, BaseException | _Done | None]] = asyncio.Queue()

    async def pump(position: int, request: GenerationRequest) -> None:
        try:
            async with aclosing(backend.generate(request)) as chunks:
                async for chunk in chunks:
                    await queue.put((position, chunk, None))
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            await queue.put((position, None, error))
        await queue.put((position, None, _Done()))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            position, chunk, status = await queue.get()
            if isinstance(status, _Done):
                remaining -= 1
            elif status is not None:
                raise status
            else:
                assert chunk is not None
                yield position, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Generation:
    """One OpenAI request in flight: its choices and token counts."""

    n: int
    num_prompts: int
    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    first_token_seen: bool = False

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n * self.num_prompts)]

    def absorb(self, position: int, chunk: GenerationChunk) -> list[tuple[Choice, Any]]:
        if chunk.num_prompt_tokens is not None:
            self.prompt_tokens[position] = chunk.num_prompt_tokens
        touched = []
        for delta in chunk.sequences:
            choice = self.choices[position * self.n + delta.index]
            choice.add(delta)
            touched.append((choice, delta))
        return touched

    def usage(self) -> dict[str, int]:
        return usage(sum(self.prompt_tokens.values()), sum(c.num_tokens for c in self.choices))
