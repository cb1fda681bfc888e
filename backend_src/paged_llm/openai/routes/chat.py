"""POST /v1/chat/completions: the messages (and tools) rendered with the model's chat template, one
Triton stream, the role chunk first when streamed (as OpenAI does).

With tools whose calls are parsed, or a reasoning parser, each choice's text goes through its
parsers (chat_output.py) into reasoning, content and tool calls; the constraint the request sends
(chat_constraint.py) is decided from the rendered prompt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from paged_llm.openai.chat_constraint import chat_constraint
from paged_llm.openai.chat_output import ChoiceOutput, deltas, message
from paged_llm.openai.edge import DisconnectWatch, read_body
from paged_llm.openai.generation import Generation, merge_streams
from paged_llm.openai.protocol import ChatCompletionRequest, parse_body
from paged_llm.openai.reasoning import PromptThinkState, ReasoningSplitter, prompt_think_state
from paged_llm.openai.responses import ResponseBuilder, chat_logprobs, sse
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
from paged_llm.openai.settings import OpenAISettings
from paged_llm.openai.state import app_state
from paged_llm.openai.tool_parsers import ToolCallParser
from paged_llm.openai.tools import call_parser
from paged_llm.openai.triton_request import GenerationChunk, GenerationRequest


async def chat_completions(request: Request) -> Response:
    return await serve(request, "chat_completions", _chat_completions)


async def _chat_completions(request: Request) -> Response:
    start = time.monotonic()
    state = app_state(request)
    settings = state.settings
    body: ChatCompletionRequest = parse_body(
        await read_body(request, settings.max_body_bytes), ChatCompletionRequest
    )
    model, lora_name = await model_and_adapter(state, body.model)
    messages = [message.template_dict(i) for i, message in enumerate(body.messages)]
    tools = body.tool_use
    parser = (
        call_parser(tools, settings.tool_call_parser, settings.enable_auto_tool_choice) if tools else None
    )
    session = session_of(request)
    prompt = await state.chat.render(
        model,
        messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
        after_an_answer=session is not None and not session.get("session_start", False),
        tools=tools.template_tools if tools else None,
    )
    think_state = prompt_think_state(prompt) if settings.reasoning_parser else "none"
    constraint = chat_constraint(
        body.constraint, tools, parser.call_format if parser else None, settings.reasoning_parser, think_state
    )
    sampling = body.sampling_parameters()
    if constraint is not None:
        sampling["structured_outputs"] = constraint.spec
    if lora_name is not None:
        sampling["lora_name"] = lora_name
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation_request = GenerationRequest(
        model,
        prompt,
        await with_generation_defaults(state, model, sampling),
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
    if constraint is not None:
        chunks = naming_the_constraint(chunks, constraint)
    outputs = _choice_outputs(settings, parser, think_state, len(generation.choices))
    watch = DisconnectWatch(request)
    if not body.stream:
        await collect(state, chunks, generation, watch)
        response = builder.chat(generation.choices, logprobs_k, generation.usage())
        if outputs is not None:
            _parsed_messages(response, outputs, settings.reasoning_parser is not None)
        return JSONResponse(response)
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

    events = chat_events if outputs is None else _parsed_events(generation, builder, outputs, logprobs_k)
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
        events,
        watch,
        roles,
    )


def _choice_outputs(
    settings: OpenAISettings,
    parser: type[ToolCallParser] | None,
    think_state: PromptThinkState,
    num_choices: int,
) -> list[ChoiceOutput] | None:
    """Each choice's parsers, None when its text is the message content as it is."""
    if parser is None and settings.reasoning_parser is None:
        return None
    return [
        ChoiceOutput(
            ReasoningSplitter(settings.reasoning_parser, think_state) if settings.reasoning_parser else None,
            parser() if parser else None,
        )
        for _ in range(num_choices)
    ]


def _parsed_messages(response: dict[str, Any], outputs: list[ChoiceOutput], with_reasoning: bool) -> None:
    for body, output in zip(response["choices"], outputs, strict=True):
        text = body["message"]["content"]
        parts = output.feed(text) + output.finish()
        body["message"] = message(parts, output.call_ids, with_reasoning)
        body["finish_reason"] = output.finish_reason(body["finish_reason"])


def _parsed_events(
    generation: Generation,
    builder: ResponseBuilder,
    outputs: list[ChoiceOutput],
    logprobs_k: int | None,
) -> Any:
    # Logprobs go with the first chunk that follows their tokens (text held back waits for its own).
    pending: list[list[Any]] = [[] for _ in outputs]

    def events(position: int, chunk: GenerationChunk) -> Iterator[bytes]:
        for choice, delta in generation.absorb(position, chunk):
            output = outputs[choice.index]
            parts = output.feed(delta.text) if delta.text else []
            if delta.finish_reason is not None:
                parts += output.finish()
            if logprobs_k is not None:
                pending[choice.index].extend(delta.logprobs or [])
            for item in deltas(parts, output.call_ids):
                yield sse(
                    builder.chat_chunk(choice.index, item, _take(pending, choice.index, logprobs_k), None)
                )
            if delta.finish_reason is not None:
                reason = output.finish_reason(delta.finish_reason)
                yield sse(
                    builder.chat_chunk(choice.index, {}, _take(pending, choice.index, logprobs_k), reason)
                )

    return events


def _take(pending: list[list[Any]], index: int, logprobs_k: int | None) -> list[dict[str, Any]] | None:
    if logprobs_k is None or not pending[index]:
        return None
    positions, pending[index] = pending[index], []
    return chat_logprobs(positions, logprobs_k)
