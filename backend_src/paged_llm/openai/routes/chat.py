"""POST /v1/chat/completions: the messages rendered with the model's chat template, one Triton
stream, the role chunk first when streamed (as OpenAI does)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from paged_llm.openai.edge import DisconnectWatch, read_body
from paged_llm.openai.generation import Generation, merge_streams
from paged_llm.openai.protocol import ChatCompletionRequest, parse_body
from paged_llm.openai.responses import ResponseBuilder, chat_logprobs, sse
from paged_llm.openai.routes.generation_flow import (
    collect,
    first_chunk,
    serve,
    sse_response,
    with_generation_defaults,
)
from paged_llm.openai.session_headers import session_of
from paged_llm.openai.state import app_state
from paged_llm.openai.triton_request import GenerationChunk, GenerationRequest


async def chat_completions(request: Request) -> Response:
    return await serve(request, "chat_completions", _chat_completions)


async def _chat_completions(request: Request) -> Response:
    start = time.monotonic()
    state = app_state(request)
    body: ChatCompletionRequest = parse_body(
        await read_body(request, state.settings.max_body_bytes), ChatCompletionRequest
    )
    await state.models.check(body.model)
    messages = [message.template_dict(i) for i, message in enumerate(body.messages)]
    session = session_of(request)
    prompt = await state.chat.render(
        body.model,
        messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
        after_an_answer=session is not None and not session.get("session_start", False),
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation_request = GenerationRequest(
        body.model,
        prompt,
        await with_generation_defaults(state, body.model, body.sampling_parameters()),
        body.stream,
        body.logprobs,
        request_id,
        session,
        bool(body.add_special_tokens),  # default off: the template's text holds its own BOS
    )
    logprobs_k = (body.top_logprobs or 0) if body.logprobs else None
    builder = ResponseBuilder("chat", request_id, body.model, body.include_usage)
    generation = Generation(body.n, 1)
    chunks = merge_streams(state.triton, [generation_request])
    watch = DisconnectWatch(request)
    if not body.stream:
        await collect(state, chunks, generation, watch)
        return JSONResponse(builder.chat(generation.choices, logprobs_k, generation.usage()))
    first = await first_chunk(watch, chunks)

    def chat_events(position: int, chunk: GenerationChunk) -> Iterator[bytes]:
        for choice, delta in generation.absorb(position, chunk):
            if (delta.text or delta.num_tokens) and logprobs_k is None:
                yield builder.text_event(choice.index, delta.text, None)
            elif delta.text or delta.num_tokens:
                logprobs = chat_logprobs(delta.logprobs or [], logprobs_k)
                yield sse(builder.chat_chunk(choice.index, {"content": delta.text}, logprobs, None))
            if delta.finish_reason is not None:
                yield sse(builder.chat_chunk(choice.index, {}, None, delta.finish_reason))

    roles = [  # the role first, as OpenAI does
        sse(builder.chat_chunk(choice.index, {"role": "assistant", "content": ""}, None, None))
        for choice in generation.choices
    ]
    return sse_response(
        state,
        chunks,
        first,
        generation,
        builder,
        body.include_usage,
        "chat_completions",
        start,
        chat_events,
        watch,
        roles,
    )
