"""POST /v1/completions: one Triton stream per prompt and choice, echo and logprobs as OpenAI's."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from paged_llm.openai.edge import DisconnectWatch, read_body
from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.generation import Generation, merge_streams
from paged_llm.openai.protocol import CompletionRequest, parse_body
from paged_llm.openai.responses import CompletionLogprobs, ResponseBuilder, sse
from paged_llm.openai.routes.generation_flow import (
    collect,
    first_chunk,
    model_and_adapter,
    naming_the_constraint,
    serve,
    sse_response,
    with_generation_defaults,
)
from paged_llm.openai.session_headers import session_of
from paged_llm.openai.state import app_state
from paged_llm.openai.triton_request import GenerationChunk, GenerationRequest


async def completions(request: Request) -> Response:
    return await serve(request, "completions", _completions)


async def _completions(request: Request) -> Response:
    start = time.monotonic()
    state = app_state(request)
    body: CompletionRequest = parse_body(
        await read_body(request, state.settings.max_body_bytes), CompletionRequest
    )
    model, lora_name = await model_and_adapter(state, body.model)
    prompts = body.prompts()
    echo_texts = [""] * (len(prompts) * body.n)
    if body.echo:
        for position, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else await state.chat.decode(model, prompt)
            for index in range(body.n):
                echo_texts[position * body.n + index] = text
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sampling = body.sampling_parameters()
    constraint = body.constraint
    if constraint is not None:
        sampling["structured_outputs"] = constraint.spec
    if lora_name is not None:
        sampling["lora_name"] = lora_name
    sampling = await with_generation_defaults(state, model, sampling)
    session = session_of(request)
    if session is not None and len(prompts) != 1:
        raise OpenAIError(400, f"a session's turn has one prompt, got {len(prompts)}", "prompt")
    generation_requests = [
        GenerationRequest(
            model,
            prompt,
            sampling,
            body.stream,
            body.logprobs is not None,
            f"{request_id}-{i}",
            session,
            body.add_special_tokens if body.add_special_tokens is not None else True,
        )
        for i, prompt in enumerate(prompts)
    ]
    builder = ResponseBuilder("completion", request_id, body.model, body.include_usage)
    generation = Generation(body.n, len(prompts))
    chunks = merge_streams(state.triton, generation_requests)
    if constraint is not None:
        chunks = naming_the_constraint(chunks, constraint)
    watch = DisconnectWatch(request)
    if not body.stream:
        await collect(state, chunks, generation, watch)
        return JSONResponse(
            builder.completion(generation.choices, echo_texts, body.logprobs, generation.usage())
        )
    first = await first_chunk(watch, chunks)
    logprob_builders = [CompletionLogprobs(body.logprobs or 0) for _ in generation.choices]

    def completion_events(position: int, chunk: GenerationChunk) -> Iterator[bytes]:
        for choice, delta in generation.absorb(position, chunk):
            if not delta.text and delta.finish_reason is None and not delta.num_tokens:
                continue
            text = delta.text
            if not choice.started:
                text = echo_texts[choice.index] + text
                choice.started = True
            if body.logprobs is None:
                yield builder.text_event(choice.index, text, delta.finish_reason)
                continue
            logprobs = logprob_builders[choice.index].add(delta.logprobs or [])
            yield sse(builder.completion_chunk(choice.index, text, logprobs, delta.finish_reason))

    return sse_response(
        state,
        chunks,
        first,
        generation,
        builder,
        body.include_usage,
        "completions",
        start,
        completion_events,
        watch,
    )
