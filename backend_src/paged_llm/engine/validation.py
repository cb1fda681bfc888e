"""Request checks that depend on the loaded model and KV pool (EngineCoreInfo), torch-free so the
stub runs them before anything is queued; the core runs them again."""

from __future__ import annotations

from paged_llm.engine.core_types import EngineCoreInfo
from paged_llm.errors import InvalidRequestError
from paged_llm.sampling_params import SamplingParams


def validate_prompt(info: EngineCoreInfo, prompt_token_ids: list[int], field: str = "text_input") -> None:
    """Raises InvalidRequestError for prompts that can never be served (checked before queueing).
    `field`: the input the prompt came in (text_input or input_ids), named in the error."""
    num_tokens = len(prompt_token_ids)
    if num_tokens == 0:
        raise InvalidRequestError(field, "the prompt is empty")
    if num_tokens >= info.max_model_len:
        raise InvalidRequestError(
            field,
            f"the prompt has {num_tokens} tokens but max_model_len is {info.max_model_len}, "
            f"which leaves no room for output (at most {info.max_model_len - 1} prompt tokens)",
        )
    vocab = info.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    num_blocks = -(-(num_tokens + 1) // info.block_size_tokens)
    if num_blocks > info.num_kv_blocks:
        raise InvalidRequestError(
            field,
            f"the prompt needs {num_blocks} KV blocks but the whole pool has {info.num_kv_blocks}",
        )


def validate_params(info: EngineCoreInfo, params: SamplingParams, in_core: bool = True) -> None:
    """Checks of sampling parameters that depend on the model (vocabulary, context length).
    `in_core` False: a stub's check, whose adapter names are those of start-up (where adapters
    load while serving, the core checks the name)."""
    params.validate_for_vocab(info.vocab_size)
    name = params.lora_name
    if name is not None and name not in info.lora_names and (in_core or not info.lora_runtime_updates):
        loaded = ", ".join(repr(name) for name in info.lora_names) or "none"
        raise InvalidRequestError("lora_name", f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
    if params.max_tokens is not None and params.max_tokens > info.max_model_len:
        raise InvalidRequestError(
            "max_tokens", f"{params.max_tokens} exceeds max_model_len {info.max_model_len}"
        )


def validate_context_fit(info: EngineCoreInfo, num_prompt_tokens: int, params: SamplingParams) -> None:
    """For clients that want OpenAI's behaviour (the OpenAI server asks with a request parameter):
    a prompt plus max_tokens past the context is refused, where the engine would stop at
    max_model_len with finish_reason "length". vLLM's OpenAI server refuses it in these words."""
    if params.max_tokens is None or num_prompt_tokens + params.max_tokens <= info.max_model_len:
        return
    raise InvalidRequestError(
        "max_tokens",
        f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
        f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the messages, "
        f"{params.max_tokens} in the completion). Please reduce the length of the messages or completion.",
    )
