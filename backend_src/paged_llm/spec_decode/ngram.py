"""N-gram prompt lookup (vLLM's `ngram` method): propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, trying the longest n first. Pure Python.

    tokens:   a b c d x y a b c          last 3 = [a b c], seen at 0  -> propose [d x y ...]
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(
    token_ids: Sequence[int], num_speculative_tokens: int, max_n: int = 4, min_n: int = 1
) -> list[int]:
    """Up to `num_speculative_tokens` proposed next tokens; [] when no n-gram of length max_n down to
    min_n recurs. The match must end before the suffix itself; the latest match wins (recent text
    predicts best), and its continuation may run into the suffix (repetitions propagate)."""
    if num_speculative_tokens <= 0 or min_n < 1 or max_n < min_n:
        return []
    length = len(token_ids)
    tokens = list(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Latest start s < length - n with tokens[s : s + n] == suffix.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = start + n
                return tokens[follow : follow + num_speculative_tokens]
    return []
