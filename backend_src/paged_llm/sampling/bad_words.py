"""vLLM's `bad_words`: words the output never contains, as banned token sequences.

Each word is tokenized twice, as given (leading spaces stripped) and with one leading space (a BPE
tokenizer spells a word differently at the start of the text and after a space). At each step, for
every such sequence whose tokens but the last end the output so far, the last token is banned
(forced to -inf before sampling); a one-token sequence is banned at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from paged_llm.sampling_params import SamplingParams


def with_bad_words_tokenized(params: SamplingParams, tokenize: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with `bad_words_token_ids` filled from `bad_words` (the stub calls it)."""
    if not params.bad_words:
        return params
    sequences: list[tuple[int, ...]] = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            token_ids = tuple(tokenize(text))
            if token_ids and token_ids not in sequences:
                sequences.append(token_ids)
    return replace(params, bad_words_token_ids=tuple(sequences))


def banned_token_ids(
    bad_words_token_ids: Sequence[tuple[int, ...]], output_token_ids: Sequence[int]
) -> list[int]:
    """The tokens that would complete a bad word now."""
    banned = []
    num_output = len(output_token_ids)
    for sequence in bad_words_token_ids:
        num_prefix = len(sequence) - 1
        if num_prefix == 0 or (
            num_output >= num_prefix and tuple(output_token_ids[num_output - num_prefix :]) == sequence[:-1]
        ):
            banned.append(sequence[-1])
    return banned
