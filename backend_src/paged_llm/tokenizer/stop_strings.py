"""Stop-string matching over a stream of text deltas (vLLM semantics).

Text that might be the beginning of a stop string is held back until it is resolved, so a client never
sees a stop string (or a piece of one) that is later cut off. Matching is on text, not tokens: a stop
string split across tokens, or starting inside held-back text, is found the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string was found in the matcher's buffer."""

    stop: str  # the stop string that matched
    start_char: int  # index of its first character in the buffer searched
    end_char: int  # index one past its last character


def find_first_stop(text: str, stops: Sequence[str]) -> StopMatch | None:
    """The match that completes first in `text` (smallest end; ties go to the longer stop string).

    "Completes first" rather than "starts first" makes the result independent of how the text was
    chunked: feeding one character at a time would stop at exactly this match, and so does feeding
    everything at once. When no stop string contains another one, the two rules agree.
    """
    best: StopMatch | None = None
    for stop in stops:
        start_char = text.find(stop)
        if start_char < 0:
            continue
        end_char = start_char + len(stop)
        if best is None or (end_char, start_char) < (best.end_char, best.start_char):
            best = StopMatch(stop=stop, start_char=start_char, end_char=end_char)
    return best


def longest_partial_stop_suffix_chars(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (0 if none)."""
    best_chars = 0
    for stop in stops:
        # Only suffixes longer than the best so far can improve it; a proper prefix is < len(stop).
        for prefix_chars in range(min(len(stop) - 1, len(text)), best_chars, -1):
            if text.endswith(stop[:prefix_chars]):
                best_chars = prefix_chars
                break
    return best_chars


class StopStringMatcher:
    """Feeds stable text through stop-string detection; releases only text that can no longer be cut.

    With include_stop_str_in_output the stop string is part of the output anyway, so nothing needs to
    be held back: text is released immediately and a match only truncates what follows the stop.
    """

    def __init__(self, stops: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        # Empty stop strings would match everywhere; vLLM ignores them too. Dedupe, keep order.
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        # Longest stop string; a stop spanning deltas never needs more than this many chars of context.
        self._max_stop_chars = max((len(s) for s in self.stops), default=0)
        # Text received but not yet released because it may be the start of a stop string
        # (always empty with include_stop_str_in_output).
        self._held_text = ""
        # include_stop_str_in_output only: tail of the released text, kept as search context so a stop
        # string that begins in an earlier delta is still found.
        self._released_tail_text = ""
        # The stop string that matched, once one has; the matcher then releases nothing more.
        self.matched_stop: str | None = None

    @property
    def held_text(self) -> str:
        return self._held_text

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add stable text; return (text releasable now, matched stop string or None). With `check`
        false (the sequence has not reached min_tokens) the text is released unsearched and is no
        context for a later match: only text from after that point can stop the sequence."""
        if self.matched_stop is not None:
            return "", None
        if not self.stops or not check:
            return text, None
        if not text:
            return "", None
        if self.include_stop_str_in_output:
            return self._feed_including_stop(text)
        buffer_text = self._held_text + text
        match = find_first_stop(buffer_text, self.stops)
        if match is not None:
            self._held_text = ""
            self.matched_stop = match.stop
            return buffer_text[: match.start_char], match.stop
        held_chars = longest_partial_stop_suffix_chars(buffer_text, self.stops)
        self._held_text = buffer_text[len(buffer_text) - held_chars :]
        return buffer_text[: len(buffer_text) - held_chars], None

    def _feed_including_stop(self, text: str) -> tuple[str, str | None]:
        context_chars = len(self._released_tail_text)
        buffer_text = self._released_tail_text + text
        # Any match ends inside `text`: one lying wholly in the context would have been found earlier.
        match = find_first_stop(buffer_text, self.stops)
        if match is not None:
            self.matched_stop = match.stop
            self._released_tail_text = ""
            return text[: match.end_char - context_chars], match.stop
        keep_chars = self._max_stop_chars - 1
        self._released_tail_text = buffer_text[-keep_chars:] if keep_chars > 0 else ""
        return text, None

    def flush(self) -> str:
        """Release held-back text (generation ended for a reason other than a stop string)."""
        held_text, self._held_text = self._held_text, ""
        return held_text
