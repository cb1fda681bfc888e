"""IncrementalDetokenizer: streamed deltas equal the one-shot decode, never split a character, and stop
strings follow vLLM semantics. Uses Qwen's real byte-level vocabulary plus a small SentencePiece-style
(Metaspace + byte fallback) tokenizer built in memory."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from paged_llm.models.tiny_model import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, ensure_tiny_model
from paged_llm.tokenizer.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, decode_token
from paged_llm.tokenizer.stop_strings import StopStringMatcher
from tests.unit.sentencepiece_tokenizer import sentencepiece_tokenizer

FFFD = "\ufffd"
THINK_ID = 151667  # "<think>": an added token that is not special (kept with skip_special_tokens)

SAMPLE_TEXTS = [
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Party 🎉🎉 family 👨‍👩‍👧 flag 🇺🇸 done 🧑🏽‍💻",
    "e\u0301 cafe\u0301 नमस्ते दुनिया ñ a\u0308\u0304",
    "  leading  spaces\n\n\ttabs\t\t  and   multiple    spaces \r\n end  ",
    "def f(x):\n    return {'a': [1, 2]}  # 注释 ✓\n\n\tprint(f\"{x!r}\")\n",
]


@pytest.fixture(scope="module")
def qwen() -> Any:
    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.fixture(scope="module")
def sentencepiece_tok() -> Any:
    return sentencepiece_tokenizer()


def encode_raw(tokenizer: Any, text: str) -> list[int]:
    """Real BPE ids without the NFC normalizer, so "e\u0301" stays a combining sequence."""
    backend = tokenizer.backend_tokenizer
    pieces = backend.pre_tokenizer.pre_tokenize_str(text)
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def one_shot(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def stream(
    tokenizer: Any, ids: Sequence[int], chunk_sizes: Sequence[int] | None = None, **kwargs: Any
) -> tuple[list[DetokenizerUpdate], str, IncrementalDetokenizer]:
    """Feed ids in chunks (default one at a time) until the end or a stop match; then finish()."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], **kwargs)
    updates: list[DetokenizerUpdate] = []
    sizes = list(chunk_sizes or [1] * len(ids))
    position = 0
    while position < len(ids):
        size = sizes.pop(0) if sizes else 1
        update = detok.update(ids[position : position + size])
        updates.append(update)
        position += size
        if update.matched_stop is not None:
            return updates, "", detok
    return updates, detok.finish(), detok


class CountingTokenizer:
    """Delegates to a real tokenizer and records the longest id list any decode call got."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_ids_per_decode = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.max_ids_per_decode = max(self.max_ids_per_decode, len(ids))
        return self.inner.decode(ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class HiddenSpecialsTokenizer(CountingTokenizer):
    """A tokenizer that does not list its special tokens, so skipped ids do reach the decoder."""

    all_special_ids: list[int] = []  # noqa: RUF012 (read-only stand-in)
    added_tokens_decoder: dict[int, Any] = {}  # noqa: RUF012


def random_chunks(rng: random.Random, num_tokens: int, max_chunk: int = 5) -> list[int]:
    return [rng.randint(1, max_chunk) for _ in range(num_tokens)]


def assert_streams_like_one_shot(
    tokenizer: Any,
    ids: Sequence[int],
    chunk_sizes: Sequence[int] | None = None,
    skip_special_tokens: bool = True,
) -> None:
    full_text = one_shot(tokenizer, ids, skip_special_tokens)
    updates, tail, detok = stream(tokenizer, ids, chunk_sizes, skip_special_tokens=skip_special_tokens)
    released = ""
    for update in updates:
        assert update.matched_stop is None
        released += update.text_delta
        # Released text is never taken back: every running concatenation is a prefix of the result,
        # so no delta can end inside a character (that would show up as U+FFFD or a mismatch here).
        assert full_text.startswith(released), (released, full_text)
        if FFFD not in full_text:
            assert FFFD not in update.text_delta
    assert released + tail == full_text
    assert detok.output_text == full_text


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_qwen_streaming_matches_one_shot_decode(qwen: Any, text: str) -> None:
    ids = encode_raw(qwen, text)
    assert one_shot(qwen, ids) == text  # the fixture really round-trips this text
    rng = random.Random(text)
    assert_streams_like_one_shot(qwen, ids)  # one token at a time
    assert_streams_like_one_shot(qwen, ids, [len(ids)])  # all at once
    for _ in range(20):
        assert_streams_like_one_shot(qwen, ids, random_chunks(rng, len(ids)))


def test_multi_token_characters_are_held_until_complete(qwen: Any) -> None:
    ids = encode_raw(qwen, " 🎉 👨‍👩‍👧")
    assert len(ids) > 4  # the emoji really are split over several tokens
    updates, tail, _ = stream(qwen, ids)
    deltas = [update.text_delta for update in updates]
    assert "".join(deltas) + tail == " 🎉 👨‍👩‍👧"
    assert all(FFFD not in delta for delta in deltas)
    assert "" in deltas  # some tokens ended mid-character and released nothing


@pytest.mark.parametrize("num_emoji_tokens", [1, 2])
def test_output_ending_in_incomplete_character_flushes_like_one_shot(
    qwen: Any, num_emoji_tokens: int
) -> None:
    ids = encode_raw(qwen, "ok 🎉")
    truncated = ids[: len(ids) - 3 + num_emoji_tokens]  # " 🎉" is 3 tokens: stop after 1 or 2 of them
    full_text = one_shot(qwen, truncated)
    assert full_text.endswith(FFFD)
    updates, tail, detok = stream(qwen, truncated)
    assert all(FFFD not in update.text_delta for update in updates)
    assert "".join(update.text_delta for update in updates) == "ok "  # complete text is not held back
    assert tail == FFFD
    assert detok.output_text == full_text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept(qwen: Any, skip_special_tokens: bool) -> None:
    ids = [*qwen.encode("Hi"), IM_END_ID, IM_START_ID, THINK_ID, *qwen.encode(" there"), ENDOFTEXT_ID]
    updates, tail, _ = stream(qwen, ids, skip_special_tokens=skip_special_tokens)
    text = "".join(update.text_delta for update in updates) + tail
    expected = (
        "Hi<|im_end|><|im_start|><think> there<|endoftext|>" if not skip_special_tokens else "Hi<think> there"
    )
    assert text == expected == one_shot(qwen, ids, skip_special_tokens)


@pytest.mark.parametrize("chunked", [False, True])
def test_sentencepiece_byte_fallback_and_leading_spaces(sentencepiece_tok: Any, chunked: bool) -> None:
    rng = random.Random(7)
    texts = ["Hello world", "Hello  world 🎉 世界 é!", " a\n\n\tb  世", "e\u0301 नमस्ते the foo"]
    for text in texts:
        ids = sentencepiece_tok.encode(text, add_special_tokens=False)
        assert one_shot(sentencepiece_tok, ids) == text
        if "🎉" in text:  # really exercised: a 4-byte character made of <0xNN> tokens
            assert sum(sentencepiece_tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids) >= 4
        for _ in range(10 if chunked else 1):
            assert_streams_like_one_shot(
                sentencepiece_tok, ids, random_chunks(rng, len(ids)) if chunked else None
            )
    # The decoder strips the first token's leading space; streaming must agree, also after a skipped <s>.
    ids = [sentencepiece_tok.convert_tokens_to_ids(piece) for piece in ["<s>", "▁Hello", "▁world"]]
    updates, tail, _ = stream(sentencepiece_tok, ids)
    assert "".join(update.text_delta for update in updates) + tail == "Hello world"


def test_byte_fallback_run_made_invalid_later(sentencepiece_tok: Any) -> None:
    """One-shot decode turns a whole <0xNN> run into U+FFFD once an invalid byte joins it, even the
    "世" that streaming already released; streaming keeps it but stays in step (same char count) and
    releases the following text without delay."""
    pieces = ["<0xE4>", "<0xB8>", "<0x96>", "<0x80>", "▁foo"]
    ids = [sentencepiece_tok.convert_tokens_to_ids(piece) for piece in pieces]
    assert one_shot(sentencepiece_tok, ids) == FFFD * 4 + " foo"
    updates, tail, _ = stream(sentencepiece_tok, ids)
    assert [update.text_delta for update in updates] == ["", "", "世", "", FFFD * 3 + " foo"]
    assert tail == ""


def test_decode_window_stays_small(qwen: Any) -> None:
    """O(1) per token: no decode call sees more than a handful of ids, however long the output."""

    ids = encode_raw(qwen, "".join(SAMPLE_TEXTS) * 20)
    counting = CountingTokenizer(qwen)
    updates, tail, _ = stream(counting, ids)
    assert len(ids) > 1000
    assert "".join(update.text_delta for update in updates) + tail == one_shot(qwen, ids)
    assert counting.max_ids_per_decode <= 12

    # A long run of skipped special tokens does not widen the window either.
    special_run_ids = [*qwen.encode("Hi"), *[IM_START_ID, IM_END_ID] * 100, *qwen.encode(" there")]
    counting = CountingTokenizer(qwen)
    updates, tail, detok = stream(counting, special_run_ids)
    assert detok.output_text == "Hi there"
    assert counting.max_ids_per_decode <= 12


@pytest.mark.parametrize("loop_piece", ["ðŁ", "ĠðŁ"])
def test_degenerate_invalid_byte_loop_is_bounded_and_exact(qwen: Any, loop_piece: str) -> None:
    # Each token ends in an incomplete byte pair, so no step ever ends on a clean character; the
    # window is split anyway (" \ufffd" pieces also exercise text released before such a split).
    loop_ids = [qwen.convert_tokens_to_ids(loop_piece)] * 300 + qwen.encode("a")
    for chunk_sizes in (None, random_chunks(random.Random(3), len(loop_ids), max_chunk=7)):
        counting = CountingTokenizer(qwen)
        _, tail, detok = stream(counting, loop_ids, chunk_sizes)
        assert detok.output_text == one_shot(qwen, loop_ids)
        assert len(detok.output_text) - len(tail) > 250  # released along the way, not all at finish()
        assert counting.max_ids_per_decode <= 40


def test_forced_split_finds_clean_boundary_in_byte_fallback_run(sentencepiece_tok: Any) -> None:
    """Chunks that never end on a character boundary inside a long <0xNN> run (3-byte Devanagari)."""
    text = "ok " + "नमस्तेदुनिया" * 3 + " the"  # one 108-byte run of <0xNN> tokens
    ids = sentencepiece_tok.encode(text, add_special_tokens=False)
    run_start = next(i for i, t in enumerate(ids) if sentencepiece_tok.convert_ids_to_tokens(t) == "<0xE0>")
    assert_streams_like_one_shot(sentencepiece_tok, ids, [run_start + 1] + [3] * len(ids))


def test_tokenizer_that_hides_its_special_ids(sentencepiece_tok: Any) -> None:
    """Skipped ids reaching the decoder must not cost the next token its leading space."""
    pieces = ["▁Hello", "<s>", "</s>", "▁world", "</s>", "▁the"]
    ids = [sentencepiece_tok.convert_tokens_to_ids(piece) for piece in pieces]
    for skip_special_tokens in (True, False):
        assert_streams_like_one_shot(
            HiddenSpecialsTokenizer(sentencepiece_tok), ids, None, skip_special_tokens
        )


# ---- stop strings ----


def stop_run(
    tokenizer: Any, text: str, stop: Sequence[str], chunk_sizes: Sequence[int] | None = None, **kwargs: Any
) -> tuple[list[DetokenizerUpdate], str, IncrementalDetokenizer]:
    return stream(tokenizer, encode_raw(tokenizer, text), chunk_sizes, stop=stop, **kwargs)


def test_stop_string_split_across_tokens(qwen: Any) -> None:
    assert qwen.convert_ids_to_tokens(encode_raw(qwen, "Hello world")) == ["Hello", "Ġworld"]
    updates, _, detok = stop_run(qwen, "Hello world peace", ["lo wor"])
    assert [update.matched_stop for update in updates] == [None, "lo wor"]
    assert updates[0].text_delta == "Hel"  # "lo" could begin the stop string: held back
    assert detok.output_text == "Hel"


def test_stop_at_first_token(qwen: Any) -> None:
    updates, _, detok = stop_run(qwen, "Hello world", ["Hello"])
    assert updates == [DetokenizerUpdate(text_delta="", matched_stop="Hello")]
    assert detok.output_text == "" and detok.matched_stop == "Hello"
    assert detok.update(qwen.encode(" more")) == DetokenizerUpdate("", None)  # inert after a match
    assert detok.finish() == ""


@pytest.mark.parametrize("chunk_sizes", [None, [100]])
def test_earliest_match_wins_over_list_order(qwen: Any, chunk_sizes: list[int] | None) -> None:
    updates, _, detok = stop_run(qwen, "The cat sat on the mat", ["mat", "cat"], chunk_sizes)
    assert updates[-1].matched_stop == "cat"
    assert detok.output_text == "The "


@pytest.mark.parametrize(("include", "expected"), [(False, "The "), (True, "The cat")])
def test_include_stop_str_in_output(qwen: Any, include: bool, expected: str) -> None:
    for chunk_sizes in (None, [100], [1, 3]):
        _, _, detok = stop_run(
            qwen, "The cat sat", ["cat", "sat"], chunk_sizes, include_stop_str_in_output=include
        )
        assert (detok.output_text, detok.matched_stop) == (expected, "cat")
    # A stop string spanning tokens, with the text before it already released.
    _, _, detok = stop_run(qwen, "Hello world peace", ["lo wor"], include_stop_str_in_output=include)
    assert detok.output_text == ("Hello wor" if include else "Hel")


def test_held_prefix_that_does_not_match_is_released(qwen: Any) -> None:
    updates, tail, detok = stop_run(qwen, "Hello world peace", ["world!", "xyz"])
    assert [update.text_delta for update in updates] == ["Hello", " ", "world peace"]  # "world" waited
    assert tail == "" and detok.matched_stop is None
    assert detok.output_text == "Hello world peace"
    # Resolved only by finish(): the held prefix is released then.
    updates, tail, detok = stop_run(qwen, "Hello world", ["world!"])
    assert (detok.output_text, tail, detok.matched_stop) == ("Hello world", "world", None)


def test_stop_starting_in_held_text(qwen: Any) -> None:
    _, _, detok = stop_run(qwen, "Hello world! more", ["world!"])
    assert (detok.output_text, detok.matched_stop) == ("Hello ", "world!")


def test_stop_before_an_incomplete_character_is_found_immediately(qwen: Any) -> None:
    ids = encode_raw(qwen, "go STOP 🎉")
    updates, _, _ = stream(qwen, ids[:-2], [len(ids) - 2], stop=["STOP"])  # ends mid-emoji
    assert updates == [DetokenizerUpdate(text_delta="go ", matched_stop="STOP")]


def test_stop_on_special_token_text_when_kept(qwen: Any) -> None:
    ids = [*qwen.encode("answer"), IM_END_ID, *qwen.encode("junk")]
    _, _, detok = stream(qwen, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert (detok.output_text, detok.matched_stop) == ("answer", "<|im_end|>")
    _, _, detok = stream(qwen, ids, stop=["<|im_end|>"], skip_special_tokens=True)
    assert (detok.output_text, detok.matched_stop) == ("answerjunk", None)


def test_stop_matcher_holds_only_longest_partial_suffix() -> None:
    matcher = StopStringMatcher(["xyz", "o w", "llo!"])
    assert matcher.feed("Hello") == ("He", None)  # "llo" is the longest proper prefix ("llo!"), not "o"
    assert matcher.held_text == "llo"
    assert matcher.feed(" there") == ("llo there", None)
    assert matcher.flush() == ""
    assert StopStringMatcher(["abcd", "c"]).feed("abcd") == ("ab", "c")  # the stop completed first wins


def reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return text[: end if include else start], stop


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.lists(st.sampled_from(["a", "b", " ab", "ba", " ", "\n", "世界", "🎉", " the"]), max_size=12),
    stops=st.lists(st.text(alphabet="ab \n世🎉t", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stop_strings_property(
    qwen: Any, words: list[str], stops: list[str], include: bool, seed: int
) -> None:
    text = "".join(words)
    ids = encode_raw(qwen, text)
    chunk_sizes = random_chunks(random.Random(seed), len(ids), max_chunk=4)
    updates, tail, detok = stream(qwen, ids, chunk_sizes, stop=stops, include_stop_str_in_output=include)
    expected_text, expected_stop = reference_stop(text, stops, include)
    assert (detok.output_text, detok.matched_stop) == (expected_text, expected_stop)
    assert "".join(update.text_delta for update in updates) + tail == expected_text


special_or_added_ids = st.sampled_from([ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, 151668])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.one_of(st.integers(0, 151642), st.integers(0, 600), special_or_added_ids), max_size=40),
    chunks=st.lists(st.integers(1, 6), max_size=40),
    skip_special_tokens=st.booleans(),
)
def test_random_ids_property(qwen: Any, ids: list[int], chunks: list[int], skip_special_tokens: bool) -> None:
    # Ids < 600 are mostly single bytes, so invalid and incomplete UTF-8 sequences are common.
    assert_streams_like_one_shot(qwen, ids, chunks, skip_special_tokens)


def test_decode_token(qwen: Any, sentencepiece_tok: Any) -> None:
    world_id = qwen.encode(" world")[0]
    assert decode_token(qwen, world_id) == " world"
    assert decode_token(qwen, IM_END_ID) == "<|im_end|>"
    assert decode_token(qwen, qwen.convert_tokens_to_ids("ðŁ")) == FFFD
    assert decode_token(qwen, world_id) is decode_token(qwen, world_id)  # cached
    assert decode_token(sentencepiece_tok, sentencepiece_tok.convert_tokens_to_ids("▁Hello")) == " Hello"
    assert decode_token(sentencepiece_tok, sentencepiece_tok.convert_tokens_to_ids("<0x41>")) == "A"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_count_only_after_min_tokens(qwen: Any, include: bool) -> None:
    """As vLLM: text of the first min_tokens tokens is released unsearched (the engine suppresses
    EOS and stop tokens as long), so "cat" in token 2 does not stop a min_tokens=3 sequence and the
    "cat" in token 5 does."""
    text = "The cat sat on the cat mat"
    assert qwen.convert_ids_to_tokens(encode_raw(qwen, text))[:6] == [
        "The",
        "Ġcat",
        "Ġsat",
        "Ġon",
        "Ġthe",
        "Ġcat",
    ]
    _, _, detok = stop_run(qwen, text, ["cat"], min_tokens=3, include_stop_str_in_output=include)
    assert detok.matched_stop == "cat"
    assert detok.output_text == ("The cat sat on the cat" if include else "The cat sat on the ")
    _, tail, detok = stop_run(qwen, "The cat sat", ["cat"], min_tokens=3)
    assert (detok.output_text, detok.matched_stop, tail) == ("The cat sat", None, "")
    _, _, detok = stop_run(qwen, text, ["cat"], min_tokens=1)  # token 2 is past min_tokens=1
    assert (detok.output_text, detok.matched_stop) == ("The ", "cat")
