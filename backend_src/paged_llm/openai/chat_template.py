"""Chat prompts: the checkpoint's own chat template (tokenizer_config.json) renders the messages.

The rendered text goes to the model as `text_input`; our llm model tokenizes it without adding
special tokens (as vLLM does for chat), so the template's own BOS / role markers are the only ones.
Where a model's checkpoint is found: `--tokenizer [MODEL=]DIR`, else the llm model's `model`
parameter in its Triton config (the built-in tiny model's name, or an absolute directory).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from paged_llm.openai.errors import OpenAIError, bad_request

logger = logging.getLogger(__name__)
# Stands for the answer a session's later turn follows; the template renders the messages after it.
_PREVIOUS_ANSWER = "PAGED_LLM_PREVIOUS_ANSWER"


def _after_previous_answer(text: str, eos_token: str | None) -> str:
    """The rendered text after the stand-in answer and its end-of-turn token (which the model
    sampled, so the server's history already holds it)."""
    marker = text.find(_PREVIOUS_ANSWER)
    if marker < 0:
        raise bad_request("the chat template dropped the conversation's previous answer", "messages")
    rest = text[marker + len(_PREVIOUS_ANSWER) :]
    if eos_token and rest.startswith(eos_token):
        rest = rest[len(eos_token) :]
    return rest


# generation_config.json fields that are sampling defaults (vLLM's --generation-config auto reads these)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults_of(directory: Path | None) -> dict[str, float | int]:
    """The sampling defaults a checkpoint recommends in its generation_config.json (none if absent)."""
    path = directory / "generation_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("%s: not read (%s); no default sampling parameters from it", path, error)
        return {}
    return {
        name: config[name]
        for name in GENERATION_DEFAULT_FIELDS
        if isinstance(config.get(name), int | float) and not isinstance(config.get(name), bool)
    }


def _render_error(error: Exception, has_template_kwargs: bool) -> OpenAIError:
    """The 400 of a template that did not render: the template's own words (its raise_exception(),
    a message it could not read), or the field that most likely made it fail; never the text of
    a Python error inside Jinja or transformers (it names their functions and types)."""
    from jinja2 import TemplateError, TemplateSyntaxError

    if isinstance(error, TemplateError) and not isinstance(error, TemplateSyntaxError):
        return bad_request(f"the chat template rejected the messages: {error}", "messages")
    logger.info("the chat template did not render: %r", error)
    if isinstance(error, TypeError) and has_template_kwargs:
        return bad_request(
            "the chat template could not be rendered with these chat_template_kwargs (a value of the "
            "wrong type, or a key the template does not take)",
            "chat_template_kwargs",
        )
    return bad_request(
        "the chat template could not render these messages (a message field of a type it does not take?)",
        "messages",
    )


class ChatTemplates:
    """What the OpenAI server reads of a model's checkpoint: its tokenizer and chat template, and
    the sampling defaults of its generation_config.json."""

    def __init__(
        self,
        tokenizer_dirs: dict[str, Path],
        default_dir: Path | None,
        backend: Any,
        chat_template: str | None = None,
    ) -> None:
        self._dirs = dict(tokenizer_dirs)
        self._chat_template = chat_template  # --chat-template: instead of every checkpoint's own
        self._default_dir = default_dir
        self._backend = backend
        self._tokenizers: dict[str, Any] = {}
        self._generation_defaults: dict[str, dict[str, float | int]] = {}
        self._unanswered: set[str] = set()  # models whose config Triton did not answer when asked
        self._lock = asyncio.Lock()

    async def generation_defaults(self, model: str) -> dict[str, float | int]:
        """Sampling parameters a request leaves unset take these (as vLLM's OpenAI server does by
        default); read once per model."""
        if model not in self._generation_defaults:
            defaults = generation_defaults_of(await self._find_dir(model))
            if model in self._unanswered:  # not known yet: this request goes without, the next asks
                return defaults
            if defaults:
                logger.warning(
                    "model %s: default sampling parameters from its generation_config.json: %s "
                    "(--generation-config vllm ignores them)", model, defaults,
                )  # fmt: skip
            self._generation_defaults[model] = defaults
        return self._generation_defaults[model]

    async def _find_dir(self, model: str) -> Path | None:
        if model in self._dirs:
            return self._dirs[model]
        if self._default_dir is not None:
            return self._default_dir
        try:
            parameters = await self._backend.model_parameters(model)
        except Exception as error:
            logger.info("no model config for %s: %s", model, error)
            self._unanswered.add(model)  # Triton did not answer: worth asking again
            return None
        self._unanswered.discard(model)
        name = parameters.get("model", "")
        from paged_llm.models.builtin import TINY_MODEL_NAME, resolve_model_dir

        if name == TINY_MODEL_NAME or Path(name).is_absolute():
            try:
                return await asyncio.to_thread(resolve_model_dir, name)
            except Exception as error:
                logger.info("model %s: checkpoint %r not usable here: %s", model, name, error)
        return None

    async def tokenizer(self, model: str) -> Any:
        """The model's HF tokenizer (loaded once), or a 400 saying how to give one."""
        async with self._lock:
            if model not in self._tokenizers:
                directory = await self._find_dir(model)
                if directory is None:
                    raise bad_request(
                        f"no tokenizer for model {model!r}: start the server with --tokenizer {model}=DIR "
                        "(a checkpoint directory with tokenizer_config.json)",
                        "model",
                    )
                from transformers import AutoTokenizer

                try:
                    self._tokenizers[model] = await asyncio.to_thread(
                        AutoTokenizer.from_pretrained, str(directory)
                    )
                except Exception:
                    logger.exception("model %s: loading the tokenizer in %s failed", model, directory)
                    raise OpenAIError(
                        500, f"the tokenizer of model {model!r} could not be loaded (the server log says why)"
                    ) from None
            return self._tokenizers[model]

    async def render(
        self,
        model: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        after_an_answer: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of `messages`. `after_an_answer`: they continue a conversation whose last
        message is an answer the model generated and the server keeps (a session's later turn), so
        the text is what the template puts after that answer, not a conversation's start: for
        ChatML, "\n<|im_start|>user\n...", the newline that follows the answer's <|im_end|>
        included (the model generated the <|im_end|> itself; the newline is the template's).
        `tools`: the request's tool definitions, for a template that renders them."""
        tokenizer = await self.tokenizer(model)
        template = self._chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise bad_request(f"model {model!r} has no chat template; use /v1/completions", "model")
        if isinstance(template, str) and "developer" not in template:
            # OpenAI's newer name for system instructions; a template that does not know it (Qwen's,
            # Llama's) would drop the message without a word
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        if after_an_answer:
            messages = [{"role": "assistant", "content": _PREVIOUS_ANSWER}, *messages]
        try:
            text = await asyncio.to_thread(  # a long conversation must not stall the event loop
                tokenizer.apply_chat_template,
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **({"chat_template": self._chat_template} if self._chat_template else {}),
                **({"tools": tools} if tools else {}),
                **(template_kwargs or {}),
            )
        except OpenAIError:
            raise
        except Exception as error:
            raise _render_error(error, bool(template_kwargs)) from None
        if after_an_answer and isinstance(text, str):
            text = _after_previous_answer(text, getattr(tokenizer, "eos_token", None))
        if not isinstance(text, str) or not text:
            raise bad_request("the chat template rendered an empty prompt", "messages")
        return text

    async def warm_up(self, models: list[str], model_list: Any) -> bool:
        """Loads and renders once what the first request of each of `models` would (tokenizer,
        chat template, generation_config defaults; `model_list`'s index and configs of
        tritonserver). False while tritonserver does not answer (worth trying again); a model
        without a tokenizer or chat template is warm as it is (its requests get their 400)."""
        try:
            await model_list.refresh()
        except OpenAIError:
            return False
        for model in models:
            await self.generation_defaults(model)
            if model in self._unanswered:
                return False
            try:
                await self.render(model, [{"role": "user", "content": "warm-up"}], True, False, None)
            except OpenAIError as error:
                logger.info("model %s: no chat prompts to warm up (%s)", model, error.message)
        return True

    async def decode(self, model: str, token_ids: list[int]) -> str:
        tokenizer = await self.tokenizer(model)
        return tokenizer.decode(token_ids)
