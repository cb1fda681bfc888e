"""What the OpenAI server tells a client when something fails names the field and the reason, never
a pid, a module, a Python exception class or a library function (issue 41 row 8)."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from paged_llm.openai.errors import OpenAIError
from paged_llm.openai.protocol import RESERVED_TEMPLATE_KWARGS, ChatCompletionRequest, parse_body

# A module path or a call (jinja2.environment.Template.render(), int()), a class name, a pid.
_INTERNALS = re.compile(
    r"[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*|\w+\(\)|\w*(Error|Exception)\b|\bpid\b|\bStatusCode\b|Traceback"
)


def _clean(error: OpenAIError) -> OpenAIError:
    assert not _INTERNALS.search(error.message), error.message
    return error


def _chat_body(template_kwargs: str) -> bytes:
    return (
        b'{"model": "llm", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
        + template_kwargs.encode()
        + b"}"
    )


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_a_reserved_chat_template_kwarg_is_a_400_naming_it_and_the_reserved_keys(key):
    with pytest.raises(OpenAIError) as info:
        parse_body(_chat_body(f'{{"{key}": []}}'), ChatCompletionRequest)
    error = _clean(info.value)
    assert (error.status_code, error.param) == (400, "chat_template_kwargs")
    assert f"may not set {key}:" in error.message
    assert "reserved keys: add_generation_prompt, chat_template," in error.message


def _render(tiny_model_dir, messages, template_kwargs) -> OpenAIError:
    from paged_llm.openai.chat_template import ChatTemplates

    templates = ChatTemplates({"llm": tiny_model_dir}, None, backend=None)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(templates.render("llm", messages, True, False, template_kwargs))
    return _clean(info.value)


@pytest.mark.parametrize(
    ("messages", "template_kwargs", "param"),
    [
        # what the template is rendered with (jinja2 raises "Template.render() got multiple values")
        ([{"role": "user", "content": "hi"}], {"messages": []}, "chat_template_kwargs"),
        ([{"role": "user", "content": "hi"}], {"add_generation_prompt": 3}, "chat_template_kwargs"),
        # a message the template cannot read (transformers' own ValueError / TypeError)
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}], None, "messages"),
    ],
)
def test_a_template_that_does_not_render_is_a_400_naming_the_field(
    tiny_model_dir, messages, template_kwargs, param
):
    error = _render(tiny_model_dir, messages, template_kwargs)
    assert (error.status_code, error.param) == (400, param), error.message


def test_a_dead_stub_and_a_broken_or_missing_tritonserver_are_503s_without_library_text():
    from paged_llm.openai.triton_client import BackendError, TritonClient, classify_error_message
    from paged_llm.openai.triton_request import GenerationRequest

    dead = _clean(classify_error_message("Stub process 'llm_0_0' is not healthy."))
    assert dead.status_code == 503 and "llm_0_0" not in dead.message

    with socket.socket() as sock:  # a port nothing listens on (bound, then closed)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def generate() -> BackendError:
        address = f"127.0.0.1:{port}"
        backend = TritonClient(address, http_url=address)
        try:
            with pytest.raises(BackendError) as info:
                async for _chunk in backend.generate(GenerationRequest("llm", [1], {}, True, False, "r")):
                    pass
            return info.value
        finally:
            await backend.close()

    unreachable = _clean(asyncio.run(generate()))
    assert unreachable.status_code == 503 and f"127.0.0.1:{port}" in unreachable.message


def test_a_model_list_tritonserver_does_not_answer_is_a_503_without_its_client_librarys_text():
    from tritonclient.utils import InferenceServerException

    from paged_llm.openai.model_list import ModelList

    async def fetch() -> list[str]:
        raise InferenceServerException("[StatusCode.UNAVAILABLE] failed to connect to all addresses")

    async def check() -> OpenAIError:
        with pytest.raises(OpenAIError) as info:
            await ModelList(fetch).check("llm")
        return info.value

    error = _clean(asyncio.run(check()))
    assert error.status_code == 503 and error.message == "tritonserver is not reachable"
