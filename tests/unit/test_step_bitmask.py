"""StepBitmask: the rows it fills on its fill thread (over several of xgrammar's threads, as on a
large host) are the rows each matcher fills alone; rows without a grammar, or whose grammar or
sequence ended, allow everything; the step before's tokens, handed to the fill, are taken first."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import pytest
import torch
import xgrammar

from paged_llm.sequence import GrammarRejectedToken, GrammarTokens
from paged_llm.structured_output import grammar as grammar_module
from paged_llm.structured_output.grammar import SequenceGrammar, StepBitmask
from paged_llm.structured_output.tokenizer_info import build_tokenizer_info
from paged_llm.testing.grammar_walk import allowed_token_ids, walk_randomly

VOCAB_SIZE = 151936
EOS = 151645


@dataclass
class Row:
    grammar: SequenceGrammar | None
    is_finished: bool = False


@pytest.fixture(scope="module")
def compiled(tiny_model_dir):
    info = build_tokenizer_info(tiny_model_dir, VOCAB_SIZE, [EOS])
    return xgrammar.GrammarCompiler(info).compile_regex("(ab|cd){2,40}e")


def _rows(compiled, num_rows: int, seed: int) -> list[Row]:
    """Matchers at assorted depths, some rows unconstrained, one grammar ended."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        if index % 5 == 4:
            rows.append(Row(None))
            continue
        grammar = SequenceGrammar(compiled)
        walk_randomly(grammar, rng.randint(0, 12), rng, VOCAB_SIZE, EOS)
        rows.append(Row(grammar))
    ended = SequenceGrammar(compiled)
    for token in ("ab", "ab", "e"):
        assert ended.matcher.accept_string(token)
    assert ended.accept_token(EOS) and ended.is_terminated()
    rows[1] = Row(ended)
    return rows


def _alone(rows: list[Row]) -> torch.Tensor:
    expected = torch.full(xgrammar.get_bitmask_shape(len(rows), VOCAB_SIZE), -1, dtype=torch.int32)
    for index, row in enumerate(rows):
        if row.grammar is not None and not row.grammar.is_terminated():
            row.grammar.matcher.fill_next_token_bitmask(expected, index)
    return expected


@pytest.mark.parametrize("max_threads", [1, 2])  # grammar_fill_threads
@pytest.mark.parametrize("num_rows", [2, 6, 40])
def test_started_fill_is_each_matchers_own(compiled, monkeypatch, num_rows, max_threads):
    monkeypatch.setattr(grammar_module, "MIN_ROWS_PER_THREAD", 4)
    rows = _rows(compiled, num_rows, seed=num_rows)
    expected = _alone(rows)
    bitmask = StepBitmask(64, VOCAB_SIZE, torch.device("cpu"), pin_memory=False, max_threads=max_threads)
    try:
        for _ in range(3):  # both host buffers, and one of them again (stale rows overwritten)
            started = bitmask.finish(bitmask.start(rows))
            assert started is not None and torch.equal(started, expected)
        assert torch.equal(bitmask.fill(rows), expected)
        assert bitmask.fill([Row(None)] * 4) is None
        assert bitmask.finish(bitmask.start([Row(None)] * 4)) is None
        ended = [rows[1], Row(None)]  # every grammar ended: rows that allow all, nothing to fill
        assert torch.equal(bitmask.finish(bitmask.start(ended)), torch.full_like(expected[:2], -1))
        live = [row for row in rows if row.grammar is not None and not row.grammar.is_terminated()]
        few = live[: grammar_module.MAX_INLINE_FILL_ROWS]
        pending = bitmask.start(few)  # a row or two: filled on this thread, nothing handed over
        assert pending.future is None and torch.equal(bitmask.finish(pending), _alone(few))
        if len(live) > grammar_module.MAX_INLINE_FILL_ROWS:  # more: on the fill thread
            pending = bitmask.start(live)
            assert pending.future is not None and torch.equal(bitmask.finish(pending), _alone(live))
    finally:
        bitmask.close()


def test_the_fill_thread_lowers_the_gil_switch_interval(compiled):
    """The fill thread must get the GIL while the engine's thread runs Python (to enter xgrammar's
    call): the first start() that uses it lowers the process's switch interval, never raises it."""
    saved = sys.getswitchinterval()
    num_rows = grammar_module.MAX_INLINE_FILL_ROWS + 1
    bitmask = StepBitmask(num_rows, VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    try:
        sys.setswitchinterval(0.005)
        bitmask.finish(bitmask.start([Row(SequenceGrammar(compiled))]))  # filled inline
        assert sys.getswitchinterval() == pytest.approx(0.005)
        bitmask.finish(bitmask.start([Row(SequenceGrammar(compiled)) for _ in range(num_rows)]))
        assert sys.getswitchinterval() == pytest.approx(grammar_module.FILL_SWITCH_INTERVAL_S)
        other = StepBitmask(num_rows, VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
        sys.setswitchinterval(0.00002)
        other.finish(other.start([Row(SequenceGrammar(compiled)) for _ in range(num_rows)]))
        assert sys.getswitchinterval() == pytest.approx(0.00002)
        other.close()
    finally:
        bitmask.close()
        sys.setswitchinterval(saved)


def test_grammars_take_a_steps_tokens_in_one_call_as_one_by_one(compiled):
    """SequenceGrammar.accept_tokens (the scheduler's batched accept) leaves each grammar where
    accept_token leaves its twin, and refuses what it refuses, without moving that grammar."""
    rows, twins = _rows(compiled, 12, seed=5), _rows(compiled, 12, seed=5)
    pairs = [(row.grammar, twin.grammar) for row, twin in zip(rows, twins) if row.grammar is not None]
    pairs = [(grammar, twin) for grammar, twin in pairs if not grammar.is_terminated()]
    tokens = [EOS if index % 3 == 2 else 0 for index in range(len(pairs))]  # "!" never fits
    masks = _alone([Row(grammar) for grammar, _ in pairs])
    for index in range(0, len(pairs), 3):  # a token its grammar allows, for a third of the rows
        choices = [t for t in allowed_token_ids(masks[index : index + 1], VOCAB_SIZE) if t != EOS]
        tokens[index] = choices[0] if choices else EOS  # a completed grammar allows only EOS
    batched = SequenceGrammar.accept_tokens([grammar for grammar, _ in pairs], tokens)
    one_by_one = [twin.accept_token(token) for (_, twin), token in zip(pairs, tokens)]
    assert batched == one_by_one and True in batched and False in batched
    after = _alone([Row(grammar) for grammar, _ in pairs])
    assert torch.equal(after, _alone([Row(twin) for _, twin in pairs]))


def test_fills_and_the_engine_threads_waits_are_counted(compiled):
    """BitmaskTimes: a fill on either thread counts once; only a wait for the fill thread adds to
    wait_seconds; steps without a constrained row to fill count nothing."""
    rows = _rows(compiled, 12, seed=3)
    bitmask = StepBitmask(64, VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    try:
        bitmask.fill(rows)  # on this thread
        assert bitmask.times.num_fills == 1 and bitmask.times.fill_seconds > 0.0
        assert bitmask.times.wait_seconds == 0.0
        bitmask.finish(bitmask.start(rows))  # on the fill thread; finish waits for it
        assert bitmask.times.num_fills == 2 and bitmask.times.wait_seconds > 0.0
        bitmask.finish(bitmask.start([Row(None)] * 3))
        bitmask.finish(bitmask.start([rows[1]]))  # its grammar ended: nothing to fill
        assert bitmask.times.num_fills == 2
    finally:
        bitmask.close()


def _allowed_tokens(grammars: list[SequenceGrammar], rng: random.Random) -> list[int]:
    masks = _alone([Row(grammar) for grammar in grammars])
    tokens = []
    for index in range(len(grammars)):
        choices = [t for t in allowed_token_ids(masks[index : index + 1], VOCAB_SIZE) if t != EOS]
        tokens.append(rng.choice(choices))
    return tokens


@pytest.mark.parametrize("num_rows", [1, 9])  # taken and filled inline; on the fill thread
def test_a_fill_takes_the_tokens_handed_to_it_first(tiny_model_dir, num_rows):
    """start(seqs, grammar_tokens): the grammars take the step before's tokens (the engine's
    thread left them to the fill), then the rows are filled: the mask each twin fills after taking
    its token alone. A sequence that ended needs no mask (its grammar may not have taken its last
    token), nor one whose handed token ends its grammar. A token a grammar does not allow fails the
    fill (finish raises)."""
    info = build_tokenizer_info(tiny_model_dir, VOCAB_SIZE, [EOS])
    compiled = xgrammar.GrammarCompiler(info).compile_regex("(ab|cd)+")  # never only EOS
    rng = random.Random(num_rows)
    rows = [Row(SequenceGrammar(compiled)) for _ in range(num_rows)]
    twins = [Row(SequenceGrammar(compiled)) for _ in range(num_rows)]
    for row, twin in zip(rows, twins):  # assorted depths, each twin where its row is
        for _ in range(rng.randint(0, 6)):
            [token] = _allowed_tokens([row.grammar], rng)
            assert row.grammar.accept_token(token) and twin.grammar.accept_token(token)
    tokens = _allowed_tokens([row.grammar for row in rows], rng)
    for twin, token in zip(twins, tokens):
        assert twin.grammar.accept_token(token)
    finished = Row(SequenceGrammar(compiled), is_finished=True)
    closing = Row(SequenceGrammar(compiled))  # handed an EOS: its grammar ends, its row needs no mask
    assert closing.grammar.matcher.accept_string("ab") and closing.grammar.can_end()
    bitmask = StepBitmask(64, VOCAB_SIZE, torch.device("cpu"), pin_memory=False)
    try:
        handed = GrammarTokens(
            [row.grammar for row in [*rows, closing]], [*tokens, EOS], [False] * num_rows + [True]
        )
        pending = bitmask.start([*rows, closing, finished], handed)
        assert (pending.future is not None) == (num_rows + 1 > grammar_module.MAX_INLINE_FILL_ROWS)
        mask = bitmask.finish(pending)
        assert torch.equal(mask[:num_rows], _alone(twins)) and bool((mask[num_rows:] == -1).all())
        assert closing.grammar.is_terminated()
        [token] = _allowed_tokens([rows[0].grammar], rng)
        taken = GrammarTokens([rows[0].grammar], [token], [False])
        bitmask.finish(bitmask.start([], taken))  # taken, none filled
        assert twins[0].grammar.accept_token(token)
        assert torch.equal(_alone(rows[:1]), _alone(twins[:1]))
        bad = GrammarTokens(
            [row.grammar for row in rows], [0] * num_rows, [False] * num_rows
        )  # "!" never fits
        with pytest.raises(GrammarRejectedToken, match="did not allow"):
            bitmask.finish(bitmask.start(rows, bad))
    finally:
        bitmask.close()
