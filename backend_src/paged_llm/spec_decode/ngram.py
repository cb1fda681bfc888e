"""N-gram prompt lookup (vLLM's `ngram` method): propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, trying the longest n first. Pure Python.

    tokens:   a b c d x y a b c          last 3 = [a b c], seen at 0  -> propose [d x y ...]

When the continuation runs into the end of the sequence, the text is taken to repeat with the
period the match implies (vLLM stops there instead): a sequence ending `x x x x` proposes `x x x x`,
not the single `x` before its end.
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
                return continuation(tokens, start + n, num_speculative_tokens)
    return []


def continuation(tokens: Sequence[int], follow: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens from `follow` on, repeating tokens[follow:] past the end (the period the
    match implies: t[i] = t[i - p] with p = len(tokens) - follow)."""
    period = list(tokens[follow : follow + num_tokens])
    if len(period) >= num_tokens:
        return period
    repeats = -(-num_tokens // len(period))
    return (period * repeats)[:num_tokens]


class NgramIndex:
    """`propose_ngram` for a growing sequence, in O(max_n) per new token instead of a scan per step.

    For each n it maps every n-gram of the sequence that ends before its last token to the latest
    start of that n-gram; a lookup of the current suffix is then one dict access per n:

        tokens  a b c d x y a b c      indexed: n-grams ending at or before y (index 5)
        suffix  [a b c] -> latest start 0 -> propose tokens[3:3+k] = d x y
    """

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        assert 1 <= min_n <= max_n
        self.max_n = max_n
        self.min_n = min_n
        self._starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed_end = 0  # n-grams ending (exclusive) at or before this position are indexed

    def propose(self, token_ids: Sequence[int], num_speculative_tokens: int) -> list[int]:
        """The same proposal as `propose_ngram(token_ids, ...)`; `token_ids` must extend (or equal)
        the tokens of the previous call."""
        length = len(token_ids)
        if num_speculative_tokens <= 0 or length < 2:
            return []
        self._extend(token_ids, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._starts[n].get(tuple(token_ids[length - n :]))
            if start is not None:
                return continuation(token_ids, start + n, num_speculative_tokens)
        return []

    def _extend(self, token_ids: Sequence[int], end: int) -> None:
        for stop in range(self._indexed_end + 1, end + 1):
            for n, starts in self._starts.items():
                if stop >= n:
                    starts[tuple(token_ids[stop - n : stop])] = stop - n
        self._indexed_end = max(self._indexed_end, end)
