"""Incremental detokenization for streaming: token ids in, client-safe text deltas out.

The text of a token depends on its neighbours (byte-level BPE splits UTF-8 characters across tokens,
SentencePiece decoders strip the first token's leading space, byte-fallback tokens combine into
characters), so decoding token by token and concatenating is wrong. Re-decoding the whole output every
step is right but O(n) per token. This uses vLLM's prefix/read offsets instead: decode only a short
window that starts a few tokens back (the "prefix", whose text was already released) and release the
part of the window's text beyond the prefix's text, once it no longer ends in an incomplete character.
Context effects at the start of the window (leading-space stripping, ...) hit the prefix text and the
window text alike and cancel. Works with paged_llm's FastTokenizer and with any HF
`PreTrainedTokenizerBase`: it only needs `decode` (and, for `decode_token`, `convert_ids_to_tokens`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from paged_llm.tokenizer.fast_tokenizer import FastTokenizer
from paged_llm.tokenizer.stop_strings import StopStringMatcher

# What decoders put where bytes do not (yet) form a valid UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"
# Degenerate output (e.g. a loop of tokens that each hold an invalid byte sequence) may never reach a
# clean character boundary; past this many pending tokens the window is split anyway so decoding cost
# per token stays bounded. Normal text resolves within a few tokens and never gets here.
_MAX_PENDING_TOKENS = 16
# Tokens left pending at such a forced split: a UTF-8 character has at most 4 bytes and a token at
# least 1, so (byte-level decoding) text more than 4 tokens back can no longer change.
_FORCED_SPLIT_KEEP_TOKENS = 4
# If even the forced split cannot find a consistent point, release everything past this many tokens
# (exactness is given up only for garbage output, rather than letting the window grow forever).
_LAST_RESORT_PENDING_TOKENS = 4 * _MAX_PENDING_TOKENS


class DetokenizerUpdate(NamedTuple):
    """A named tuple: one is made per generated token, and a tuple is the cheapest to make."""

    text_delta: str  # text that may be sent to the client now (possibly empty)
    matched_stop: str | None  # the stop string that ended generation, else None


# Per-tokenizer caches, dropped with the tokenizer. Keyed weakly so a reloaded tokenizer is not pinned.
_DECODED_TOKEN_CACHE: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
_SKIPPED_IDS_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


_FAST_DECODE_CACHE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _decode_ids(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> str:
    return _decode_function(tokenizer, skip_special_tokens)(token_ids)


def _decode_function(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """Decodes ids with this tokenizer and setting (through the Rust backend where that gives the
    same text). A sequence's detokenizer looks it up once: it decodes twice a generated token, and
    the lookup would cost as much as the Rust call."""
    fast = _fast_decoder(tokenizer)
    if fast is not None:
        return functools.partial(fast.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _fast_decoder(tokenizer: Any) -> Any:
    """The Rust `tokenizers.Tokenizer` behind an HF fast tokenizer, when decoding through it gives the
    same text as `tokenizer.decode(..., clean_up_tokenization_spaces=False)`; else None.

    transformers' decode wraps the Rust call in a lot of Python (argument conversion, special-token
    bookkeeping), several microseconds per call, twice per generated token. Equivalence is checked
    once per tokenizer on its special tokens and a spread of ordinary ones, with and without skipping.
    """
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.backend_tokenizer  # its decode is the backend's by definition
    try:
        if tokenizer in _FAST_DECODE_CACHE:
            return _FAST_DECODE_CACHE[tokenizer]
    except TypeError:
        return None
    from transformers import PreTrainedTokenizerBase

    # Only real HF tokenizers: a wrapper may decode differently, or count its calls.
    backend = (
        getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(tokenizer, PreTrainedTokenizerBase)
        else None
    )
    if backend is not None and hasattr(backend, "decode"):
        probe = sorted(set(getattr(tokenizer, "all_special_ids", ()) or ()))
        size = len(tokenizer)
        probe += list(range(0, size, max(1, size // 97)))
        samples = [probe[i : i + 7] for i in range(0, len(probe), 7)] + [probe]
        for skip in (True, False):
            for ids in samples:
                slow = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                if backend.decode(ids, skip_special_tokens=skip) != slow:
                    backend = None
                    break
            if backend is None:
                break
    else:
        backend = None
    _FAST_DECODE_CACHE[tokenizer] = backend
    return backend


def _per_tokenizer(store: weakref.WeakKeyDictionary[Any, Any], tokenizer: Any, default: Any) -> Any:
    """store[tokenizer], set to `default` if missing; just `default` (uncached) if the tokenizer cannot
    be a weak key (unhashable, or a class without __weakref__)."""
    try:
        return store.setdefault(tokenizer, default)
    except TypeError:
        return default


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token on its own, for logprobs' `decoded_token` (cached per tokenizer).

    A token holding part of a UTF-8 character decodes to U+FFFD, as in vLLM/OpenAI. SentencePiece
    decoders strip the leading space of the first token of a text; a lone token is always first, so
    a "▁"-led piece gets its space back (OpenAI-style " Hello", not "Hello").
    """
    token_id = int(token_id)
    cache: dict[int, str] = _per_tokenizer(_DECODED_TOKEN_CACHE, tokenizer, {})
    text = cache.get(token_id)
    if text is None:
        text = _decode_ids(tokenizer, [token_id], skip_special_tokens=False)
        if not text.startswith(" "):
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece.startswith("▁"):
                text = " " + text
        cache[token_id] = text
    return text


def skipped_special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops wherever they occur (cached).

    Dropping them before decoding is equivalent (decoders only ever see the surviving tokens) and keeps
    runs of special tokens out of the decode window. Each candidate is checked against `decode` itself,
    because HF's notion of "special" and the backend's can differ.
    """
    try:
        cached = _SKIPPED_IDS_CACHE.get(tokenizer)
    except TypeError:  # not usable as a weak key: compute every time (a few decodes)
        cached = None
    if cached is not None:
        return cached
    candidate_ids: set[int] = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added_tokens = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidate_ids.update(
        token_id for token_id, token in added_tokens.items() if getattr(token, "special", False)
    )
    skipped_ids = frozenset(
        token_id
        for token_id in candidate_ids
        if token_id is not None and _decode_ids(tokenizer, [token_id], skip_special_tokens=True) == ""
    )
    return _per_tokenizer(_SKIPPED_IDS_CACHE, tokenizer, skipped_ids)


class _WindowDecoder:
    """Token ids -> text that later tokens cannot change, by decoding a sliding window of ids.

    Invariant: all text of ids[:read_offset] has been released, plus `_pending_released_chars` chars of
    the text of ids[read_offset:]; `_prefix_text` is decode(ids[prefix_offset:read_offset]), so the text
    of ids[read_offset:] is decode(ids[prefix_offset:])[len(prefix_text):].
    """

    def __init__(self, decode_fn: Callable[[list[int]], str]) -> None:
        self._decode = decode_fn  # decodes a list of ids with the caller's skip_special_tokens
        self._token_ids: list[int] = []  # all output ids that reach the decoder
        self._prefix_offset = 0  # start of the decode window (context whose text is already released)
        self._read_offset = 0  # first id whose text is not fully released
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._pending_released_chars = 0  # chars of ids[read_offset:]'s text already released

    def add(self, token_ids: Iterable[int]) -> None:
        self._token_ids.extend(token_ids)

    def step(self) -> str:
        """Release whatever text became stable since the last call."""
        num_tokens = len(self._token_ids)
        if num_tokens == self._read_offset:
            return ""
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        # Slicing by length, not by checking that window_text starts with the prefix text: the two
        # differ only where a decoder rewrote earlier text (byte fallback turns a whole byte run into
        # U+FFFD once an invalid byte joins it), and released text cannot be taken back anyway; the
        # char count still lines up with the one-shot decode.
        pending_text = window_text[len(self._prefix_text) :]
        if not pending_text.endswith(_REPLACEMENT_CHAR):
            delta = pending_text[self._pending_released_chars :]
            self._advance(num_tokens, window_text)
            return delta
        # The trailing U+FFFD run may be an incomplete character; everything before it is final
        # (decoders resolve bytes left to right), so release it now: a stop string in it is then
        # seen on time, and the client is not kept waiting on one unfinished emoji.
        delta = ""
        stable_chars = len(pending_text.rstrip(_REPLACEMENT_CHAR))
        if stable_chars > self._pending_released_chars:
            delta = pending_text[self._pending_released_chars : stable_chars]
            self._pending_released_chars = stable_chars
        if num_tokens - self._read_offset > _MAX_PENDING_TOKENS:
            delta += self._force_split(window_text)
        return delta

    def flush(self) -> str:
        """All text not yet released, as the one-shot decode gives it (U+FFFD for incomplete bytes)."""
        num_tokens = len(self._token_ids)
        if num_tokens == self._read_offset:
            return ""
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        delta = window_text[len(self._prefix_text) + self._pending_released_chars :]
        self._advance(num_tokens, window_text)
        return delta

    def _advance(self, new_read_offset: int, text_to_new_read: str) -> None:
        """Mark ids[:new_read_offset] released; `text_to_new_read` is decode(ids[prefix:new_read])."""
        # The released tokens become the next window's context. A context whose text is empty cannot
        # absorb start-of-text effects (e.g. SentencePiece's leading-space strip), so keep the old one.
        new_prefix_text = self._decode(self._token_ids[self._read_offset : new_read_offset])
        if new_prefix_text:
            self._prefix_offset = self._read_offset
            self._prefix_text = new_prefix_text
        else:
            self._prefix_text = text_to_new_read
        self._read_offset = new_read_offset
        self._pending_released_chars = 0

    def _force_split(self, window_text: str) -> str:
        """Release the text of a prefix of the pending ids, so the window stops growing.

        Prefers the last clean split (text up to it ends in a complete character: exact, as in step()).
        Only if there is none, the pending ids really hold invalid bytes (valid text has a clean split at
        least every 4 ids); then split a few ids before the end, where later ids can no longer change
        the text.
        """
        num_tokens = len(self._token_ids)
        for split_offset in range(num_tokens - 1, self._read_offset, -1):
            split_text = self._decode(self._token_ids[self._prefix_offset : split_offset])
            # Not checked against window_text: with byte fallback an incomplete character at the end
            # turns its whole byte run into U+FFFD for now, though the split is clean.
            if not split_text.endswith(_REPLACEMENT_CHAR):
                return self._release_up_to(split_offset, split_text)
        split_offset = num_tokens - _FORCED_SPLIT_KEEP_TOKENS
        split_text = self._decode(self._token_ids[self._prefix_offset : split_offset])
        if window_text.startswith(split_text):
            return self._release_up_to(split_offset, split_text)
        if num_tokens - self._read_offset > _LAST_RESORT_PENDING_TOKENS:
            return self._release_up_to(num_tokens, window_text)
        return ""

    def _release_up_to(self, split_offset: int, split_text: str) -> str:
        """Release the text of ids[:split_offset]; `split_text` is decode(ids[prefix:split_offset])."""
        pending_split_chars = max(0, len(split_text) - len(self._prefix_text))
        delta = split_text[len(self._prefix_text) + self._pending_released_chars :]
        # Chars released beyond the split belong to the ids still pending after it.
        carried_released_chars = max(0, self._pending_released_chars - pending_split_chars)
        self._advance(split_offset, split_text)
        self._pending_released_chars = carried_released_chars
        return delta


class IncrementalDetokenizer:
    """Streams one sequence's output text: UTF-8-safe deltas, stop strings with vLLM semantics.

    Concatenating every `text_delta` and `finish()` gives exactly
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` when no
    stop string matched. The prompt is not decoded: the output text is defined as the one-shot decode
    of the output ids alone (so a SentencePiece tokenizer drops the first output token's leading space,
    exactly as that decode does).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # Stop strings are looked for only once more than min_tokens tokens came (as vLLM does, and
        # as the engine suppresses EOS and stop tokens before that).
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # Kept for callers/debugging only; see the class docstring for why it is not decode context.
        self.num_prompt_tokens = len(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        # Ids dropped before decoding (skip_special_tokens=True only); decode would drop them anyway.
        self._skipped_ids = skipped_special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._decoder = _WindowDecoder(_decode_function(tokenizer, skip_special_tokens))
        self._stop_matcher = StopStringMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
        self._released_parts: list[str] = []  # every delta handed out, in order
        self._released_text_cache = ""  # "".join(_released_parts[:_cached_parts])
        self._cached_parts = 0
        self._finished = False  # finish() was called

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended generation (set by update, or by finish() on flushed text)."""
        return self._stop_matcher.matched_stop

    @property
    def output_text(self) -> str:
        """All text released so far (sum of deltas and finish())."""
        if self._cached_parts != len(self._released_parts):
            self._released_text_cache += "".join(self._released_parts[self._cached_parts :])
            self._cached_parts = len(self._released_parts)
        return self._released_text_cache

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Add one or several generated ids; return the text that is now safe to send."""
        if self._finished or self.matched_stop is not None:
            # Contract: the caller stops after a match / finish. Be inert rather than corrupt the text.
            return DetokenizerUpdate(text_delta="", matched_stop=None)
        skipped_ids = self._skipped_ids
        self._num_tokens += len(new_token_ids)
        self._decoder.add(token_id for token_id in map(int, new_token_ids) if token_id not in skipped_ids)
        stable_text = self._decoder.step()
        text_delta, matched_stop = self._stop_matcher.feed(stable_text, self._num_tokens > self._min_tokens)
        self._release(text_delta)
        return DetokenizerUpdate(text_delta=text_delta, matched_stop=matched_stop)

    def finish(self) -> str:
        """Generation ended without a stop string (EOS, length, abort): return the held-back text.

        The flushed text still goes through stop-string matching (it may complete a stop string that
        was waiting on an incomplete character); then the text is cut there and `matched_stop` is set.
        """
        if self._finished:
            return ""
        self._finished = True
        if self.matched_stop is not None:
            return ""
        tail_text, matched_stop = self._stop_matcher.feed(
            self._decoder.flush(), self._num_tokens > self._min_tokens
        )
        if matched_stop is None:
            tail_text += self._stop_matcher.flush()
        self._release(tail_text)
        return tail_text

    def _release(self, text: str) -> None:
        if text:
            self._released_parts.append(text)
