"""Sessions over the real scheduler and KV cache manager with the fake model of test_scheduler:
which blocks a session holds between turns, what each turn computes, eviction, expiry, truncation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from paged_llm.config import SessionConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.scheduler import Scheduler
from paged_llm.core.sessions import SessionManager, SessionTurn, truncate_with_sinks
from paged_llm.errors import InvalidRequestError, QueueFullError, SessionNotFoundError
from paged_llm.sequence import Sequence, SequenceStatus
from tests.unit.test_scheduler import ShadowKV, expected_outputs, make_scheduler, make_sequence, summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A scheduler with sessions, stepped with the fake model; integrity checked after each call."""

    def __init__(self, num_blocks: int = 32, config: SessionConfig | None = None, **kwargs) -> None:
        self.sched: Scheduler = make_scheduler(num_blocks, **kwargs)
        self.clock = Clock()
        self.sessions = SessionManager(
            config or SessionConfig(), self.sched.kv_cache, self.sched.max_model_len, self.clock
        )
        self.sched.reclaim_kv = self.sessions.reclaim_idle_kv
        self.turn_seqs: dict[str, tuple[str, Sequence]] = {}  # request id -> (session id, seq)

    def check(self) -> None:
        self.sched.check_integrity(self.sessions.kv_holders)
        self.sessions.check_integrity()

    def add_turn(
        self, session_id: str, request_id: str, new: list[int], *, max_tokens: int = 3, start: bool = False,
        end: bool = False,
    ) -> Sequence:  # fmt: skip
        turn = SessionTurn(session_id, start=start, end=end)
        prepared = self.sessions.begin_turn(turn, request_id, new, max_tokens)
        seq = make_sequence(request_id, prepared.prompt_token_ids, max_tokens=max_tokens)
        self.sessions.attach(session_id, seq)
        self.sched.add_sequence(seq)
        self.turn_seqs[request_id] = (session_id, seq)
        self.check()
        return seq

    def step(self) -> list[tuple[str, int, int, bool]]:
        output = self.sched.schedule()
        self.check()
        sampled = {
            s.seq_id: expected_outputs(s.seq_id, s.seq.num_output_tokens + 1)[-1] for s in output.scheduled
        }
        self.sched.update_from_output(output, {k: v for k, v in sampled.items() if k in sampled})
        self._close_finished()
        self.check()
        return summary(output)

    def run(self, max_steps: int = 100) -> list[list[tuple[str, int, int, bool]]]:
        steps = []
        while self.sched.has_unfinished_sequences():
            assert len(steps) < max_steps
            steps.append(self.step())
        return steps

    def abort(self, request_id: str) -> None:
        self.sched.finish_sequences([request_id], SequenceStatus.FINISHED_ABORTED)
        self._close_finished()
        self.check()

    def _close_finished(self) -> None:
        for request_id, (session_id, seq) in list(self.turn_seqs.items()):
            if seq.is_finished:
                del self.turn_seqs[request_id]
                self.sessions.end_turn(session_id, seq)

    def holder_blocks(self, session_id: str) -> list[int]:
        return self.sched.kv_cache.get_block_ids(self.sessions.get(session_id).holder)

    def assert_all_free(self) -> None:
        kv = self.sched.kv_cache
        assert kv.num_free_blocks == kv.num_blocks and not kv.seq_to_blocks


U1 = [11, 12, 13, 14, 15, 16]  # block size 4: one full block and half of the next
U2 = [21, 22]


def test_a_turn_takes_the_sessions_blocks_and_computes_only_its_new_tokens():
    h = Harness()
    h.add_turn("s", "r1", U1, start=True)
    assert h.run() == [[("r1", 0, 6, True)], [("r1", 6, 1, True)], [("r1", 7, 1, True)]]
    history = U1 + expected_outputs("r1", 3)
    session = h.sessions.get("s")
    assert session.token_ids == history
    assert session.num_kv_tokens == 8  # the last output token has no KV yet
    assert h.holder_blocks("s") == [0, 1]  # the partial block is held too, not only cached ones
    computed_before = h.sched.num_prompt_tokens_computed
    seq = h.add_turn("s", "r2", U2)
    assert seq.prompt_token_ids == history + U2
    steps = h.run()
    assert steps[0] == [("r2", 8, 3, True)]  # the last output token of turn 1 and the 2 new ones
    assert h.sched.num_prompt_tokens_computed - computed_before == 3
    assert h.holder_blocks("s") == [0, 1, 2, 3]  # grown in place: 11 + 3 tokens, the last without KV
    assert h.sessions.get("s").num_kv_tokens == 13
    assert h.sessions.stats().reused_tokens_total == 8
    assert h.sessions.close("s")
    h.assert_all_free()


def test_a_turn_hashes_only_its_new_blocks_for_the_prefix_cache(monkeypatch):
    hashed: list[int] = []  # indexes of the blocks the engine hashed (the integrity checks not counted)
    real_update = KVCacheManager.update_block_hashes

    def counting_update(self, seq):
        first = len(seq.block_hashes)
        real_update(self, seq)
        hashed.extend(range(first, len(seq.block_hashes)))

    monkeypatch.setattr(KVCacheManager, "update_block_hashes", counting_update)
    h = Harness(num_blocks=64)
    h.add_turn("s", "r1", list(range(100, 118)), start=True, max_tokens=2)
    h.run()
    assert len(h.sessions.get("s").token_ids) == 20  # 18 + 2 tokens: 5 full blocks of 4, but
    assert len(h.sessions.get("s").block_hashes) == 4  # the last output token has no KV yet
    hashed.clear()
    seq = h.add_turn("s", "r2", list(range(200, 210)), max_tokens=2)
    assert len(seq.block_hashes) == 4  # taken from the session, not recomputed
    h.run()
    # 20 + 10 + 2 = 32 tokens, the last without KV: full blocks 4 .. 6 (from history[16:20]) are new
    assert hashed == [4, 5, 6]
    assert h.sessions.get("s").block_hashes == seq.block_hashes
    h.check()  # the session's hashes are its history's (SessionManager.check_integrity recomputes)


def test_a_turn_aborted_after_admission_keeps_the_history_and_recomputes_it_from_the_prefix_cache():
    h = Harness()
    h.add_turn("s", "r1", U1, start=True)
    h.run()
    history = list(h.sessions.get("s").token_ids)
    h.add_turn("s", "r2", U2)
    h.step()  # admitted: it took the session's blocks
    h.abort("r2")
    session = h.sessions.get("s")
    assert session.token_ids == history and session.num_kv_tokens == 0
    assert not h.sched.kv_cache.holds(session.holder)
    h.add_turn("s", "r3", [31])
    # blocks 0 and 1 were full and cached by turn 1: prefix hits; history[8] and 31 are computed
    assert h.step() == [("r3", 8, 2, True)]
    h.run()
    assert h.sessions.get("s").token_ids == [*history, 31, *expected_outputs("r3", 3)]


def test_a_turn_aborted_while_waiting_leaves_the_session_its_blocks():
    h = Harness(max_num_seqs=1)
    h.add_turn("s", "r1", U1, start=True)
    h.run()
    blocking = make_sequence("other", 4, max_tokens=5)
    h.sched.add_sequence(blocking)
    h.step()
    h.add_turn("s", "r2", U2)
    h.step()  # max_num_seqs=1: r2 waits
    h.abort("r2")
    assert h.holder_blocks("s") == [0, 1] and h.sessions.get("s").num_kv_tokens == 8
    assert h.sessions.get("s").turn_request_id is None


def test_the_pool_reclaims_idle_sessions_least_recently_used_first_before_preempting():
    # 8 blocks of 4 tokens. Sessions a and b each hold 2 blocks; a request needing 6 blocks takes
    # a's first (used least recently), then b's, and nobody is preempted.
    h = Harness(num_blocks=8)
    h.add_turn("a", "ra", [1, 2, 3, 4, 5], start=True)
    h.run()
    h.add_turn("b", "rb", [6, 7, 8, 9, 10], start=True)
    h.run()
    assert h.holder_blocks("a") == [0, 1] and h.holder_blocks("b") == [2, 3]
    big = make_sequence("big", 21, max_tokens=3)
    h.sched.add_sequence(big)
    h.step()
    assert not h.sched.kv_cache.holds(h.sessions.get("a").holder)
    assert h.holder_blocks("b") == [2, 3]
    h.run()
    assert h.sched.num_preemptions_total == 0
    assert h.sessions.stats().num_evicted_total >= 1
    # a's history is intact; its next turn recomputes what the prefix cache no longer has
    h.add_turn("a", "ra2", [40])
    h.run()
    assert h.sessions.get("a").token_ids[:5] == [1, 2, 3, 4, 5]


def test_a_preempted_turn_recomputes_its_history_and_still_extends_the_session():
    h = Harness(num_blocks=6, max_num_seqs=2)
    h.add_turn("s", "r1", [1, 2, 3, 4, 5], start=True)
    h.run()
    hog = make_sequence("hog", 8, max_tokens=12)  # earlier: the turn is the one preempted
    h.sched.add_sequence(hog)
    h.step()
    turn = h.add_turn("s", "r2", [6], max_tokens=8)
    h.run()
    assert turn.num_preemptions >= 1  # the pool is too small for both to finish together
    history = [1, 2, 3, 4, 5, *expected_outputs("r1", 3), 6, *expected_outputs("r2", 8)]
    assert h.sessions.get("s").token_ids == history  # the same tokens with or without preemption


def test_ttl_not_found_busy_and_max_sessions():
    h = Harness(config=SessionConfig(max_sessions=2, session_idle_ttl_s=60.0))
    h.add_turn("a", "ra", [1, 2], start=True)
    with pytest.raises(InvalidRequestError, match="session_id: session 'a' already has a turn in flight"):
        h.add_turn("a", "ra2", [3])
    with pytest.raises(InvalidRequestError, match="session_id: session 'a' is already open"):
        h.add_turn("a", "ra3", [3], start=True)
    with pytest.raises(SessionNotFoundError, match="session_id: session 'nope' is not open"):
        h.add_turn("nope", "rn", [3])
    h.run()
    h.add_turn("b", "rb", [4], start=True)
    with pytest.raises(QueueFullError, match="max_sessions=2"):
        h.add_turn("c", "rc", [5], start=True)
    h.run()
    h.clock.now += 30
    h.add_turn("b", "rb2", [6])  # b used again: a is now the least recently used
    h.run()
    h.clock.now += 31
    assert h.sessions.expire_idle() == ["a"]
    assert h.sessions.get("b") is not None
    with pytest.raises(SessionNotFoundError):
        h.add_turn("a", "ra4", [7])
    h.sessions.close("b")
    h.assert_all_free()


def test_end_closes_the_session_after_its_turn():
    h = Harness()
    h.add_turn("s", "r1", U1, start=True)
    h.run()
    h.add_turn("s", "r2", U2, end=True)
    h.run()
    assert h.sessions.get("s") is None
    h.assert_all_free()


def test_truncate_with_sinks():
    history = list(range(10))
    assert truncate_with_sinks(history, [20, 21], 12, 2) == ([*history, 20, 21], 0)
    assert truncate_with_sinks(history, [20, 21], 8, 2) == ([0, 1, 6, 7, 8, 9, 20, 21], 4)
    assert truncate_with_sinks(history, [20, 21], 3, 0) == ([9, 20, 21], 9)
    with pytest.raises(ValueError, match="do not fit"):
        truncate_with_sinks(history, [20, 21, 22], 4, 2)


def test_a_turn_past_the_window_drops_the_middle_of_the_history_and_recomputes():
    h = Harness(config=SessionConfig(session_window_tokens=16, num_sink_tokens=2))
    h.add_turn("s", "r1", U1, start=True)  # 6 + 3 = 9 tokens of history
    h.run()
    history = list(h.sessions.get("s").token_ids)
    seq = h.add_turn("s", "r2", [21, 22, 23, 24, 25], max_tokens=4)  # 9 + 5 + 4 > 16: drop 2
    assert seq.prompt_token_ids == history[:2] + history[4:] + [21, 22, 23, 24, 25]
    assert h.sessions.stats().num_truncated_total == 1
    assert h.step() == [("r2", 0, 12, True)]  # positions changed: nothing reused
    h.run()
    assert h.sessions.get("s").token_ids == seq.prompt_token_ids + expected_outputs("r2", 4)
    with pytest.raises(InvalidRequestError, match="text_input: the turn's 14 new tokens"):
        h.add_turn("s", "r3", list(range(100, 114)), max_tokens=4)


# ------------------------------------------------------------------------------ random programs
Op = tuple[str, int, int, int]  # (kind, session index, size, max_tokens)


@st.composite
def session_programs(draw) -> tuple[int, int, list[Op]]:
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(6, 24))
    kinds = st.sampled_from(["turn", "turn", "turn", "abort", "stateless", "close", "expire", "step"])
    ops = draw(
        st.lists(
            st.tuples(kinds, st.integers(0, 2), st.integers(1, 12), st.integers(1, 6)),
            min_size=8,
            max_size=60,
        )
    )
    return block_size, num_blocks, ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=session_programs())
def test_random_session_programs_keep_every_invariant_and_read_only_their_own_kv(program) -> None:
    """Turns, aborts, stateless requests, closes and TTL expiry in random order on a small pool:
    integrity after every call, no step reads KV that is not the sequence's own (ShadowKV), each
    session's history is exactly its completed turns, and everything is free at the end."""
    block_size, num_blocks, ops = program
    max_model_len = num_blocks * block_size
    h = Harness(
        num_blocks,
        SessionConfig(session_idle_ttl_s=10.0, num_sink_tokens=2),
        block_size=block_size,
        max_model_len=max_model_len,
        budget=16,
    )
    shadow = ShadowKV(block_size)
    expected: dict[str, list[int]] = {}  # session id -> history after its completed turns
    turn_prompts: dict[str, list[int]] = {}
    counter = iter(range(10**6))

    def step() -> None:
        output = h.sched.schedule()
        h.check()
        shadow.run_step(h.sched, output)
        sampled = {
            s.seq_id: expected_outputs(s.seq_id, s.seq.num_output_tokens + 1)[-1] for s in output.scheduled
        }
        h.sched.update_from_output(
            output, {s.seq_id: sampled[s.seq_id] for s in output.scheduled if s.needs_sample}
        )
        for _request_id, (session_id, seq) in list(h.turn_seqs.items()):
            if seq.is_finished and seq.status is not SequenceStatus.FINISHED_ABORTED:
                expected[session_id] = list(seq.all_token_ids)
        h._close_finished()
        h.check()

    for kind, index, size, max_tokens in ops:
        session_id = f"s{index}"
        busy = any(sid == session_id for sid, _ in h.turn_seqs.values())
        if kind == "turn" and not busy:
            start = h.sessions.get(session_id) is None
            new = [100 + next(counter) % 900 for _ in range(size)]
            try:
                seq = h.add_turn(session_id, f"t{next(counter)}", new, max_tokens=max_tokens, start=start)
            except (InvalidRequestError, QueueFullError):
                continue  # the turn cannot fit the window even truncated
            if start:
                expected[session_id] = []
            history = expected[session_id]
            if seq.prompt_token_ids != history + new:  # truncated: sinks + the most recent tokens
                kept = seq.prompt_token_ids
                assert kept[:2] == (history + new)[:2] and kept[-len(new) :] == new
            turn_prompts[seq.seq_id] = seq.prompt_token_ids
        elif kind == "abort" and busy:
            request_id = next(r for r, (sid, _) in h.turn_seqs.items() if sid == session_id)
            h.abort(request_id)
        elif kind == "stateless":
            h.sched.add_sequence(
                make_sequence(f"x{next(counter)}", min(size * 2, max_model_len - 8), max_tokens=3)
            )
        elif kind == "close" and not busy and h.sessions.get(session_id) is not None:
            h.sessions.close(session_id)
            expected.pop(session_id, None)
            h.check()
        elif kind == "expire":
            h.clock.now += 11.0
            for expired in h.sessions.expire_idle():
                expected.pop(expired, None)
            h.check()
        for _ in range(1 + size % 4):
            if h.sched.has_unfinished_sequences():
                step()
        for session_id, history in expected.items():
            session = h.sessions.get(session_id)
            if session is not None and session.turn_request_id is None:
                assert session.token_ids == history
    guard = 0
    while h.sched.has_unfinished_sequences():
        guard += 1
        assert guard < 2000, "no progress"
        step()
    stats = h.sessions.stats()
    event(f"sessions reused KV: {stats.reused_tokens_total > 0}")
    event(f"session KV evicted: {stats.num_evicted_total > 0}")
    event(f"history truncated: {stats.num_truncated_total > 0}")
    event(f"preempted: {h.sched.num_preemptions_total > 0}")
    for index in range(4):
        h.sessions.close(f"s{index}")
    h.check()
    h.assert_all_free()


def run_steps(h: Harness, num_steps: int) -> None:
    for _ in range(num_steps):
        h.step()


def stop_at(h: Harness, request_id: str, num_output_tokens: int) -> None:
    """What the core does when the stub found a stop string after that many output tokens."""
    _session_id, seq = h.turn_seqs[request_id]
    h.sched.truncate_output(seq, num_output_tokens)
    h.sched.finish_sequences([request_id], SequenceStatus.FINISHED_STOPPED)
    h._close_finished()
    h.check()


def test_a_turn_stopped_behind_the_core_keeps_what_the_client_got_and_frees_the_rest():
    """The core ran two steps past the stop string (10 tokens, 9 with KV, block 2 begun): the history
    keeps 6 + 2 tokens, blocks 0 and 1 (both full, registered), and block 2 goes back to the pool."""
    h = Harness()
    h.add_turn("s", "r1", U1, max_tokens=6, start=True)
    run_steps(h, 4)
    assert h.sched.kv_cache.get_block_ids("r1") == [0, 1, 2]
    stop_at(h, "r1", 2)
    session = h.sessions.get("s")
    assert session.token_ids == U1 + expected_outputs("r1", 2)
    assert session.num_kv_tokens == 8 and len(session.block_hashes) == 2
    assert h.holder_blocks("s") == [0, 1]
    assert h.sched.kv_cache.num_free_blocks == 32 - 2
    h.add_turn("s", "r2", U2)
    assert h.run()[0] == [("r2", 8, 2, True)]  # only the new tokens
    assert h.holder_blocks("s") == [0, 1, 3]
    assert h.sessions.close("s")
    h.assert_all_free()


def test_a_stop_inside_a_registered_block_gives_that_block_up():
    """Stopped after 1 output token (7 tokens): block 1 is in the prefix cache under the hash of
    tokens 4-7, token 7 now dropped; the next turn writes there, so the history keeps block 0 only
    and recomputes from token 4 into a fresh block. Block 1 stays a valid cache entry."""
    h = Harness()
    h.add_turn("s", "r1", U1, max_tokens=6, start=True)
    run_steps(h, 4)
    stop_at(h, "r1", 1)
    session = h.sessions.get("s")
    assert session.token_ids == U1 + expected_outputs("r1", 1)
    assert session.num_kv_tokens == 4 and len(session.block_hashes) == 1
    assert h.holder_blocks("s") == [0]
    h.add_turn("s", "r2", U2)
    assert h.run()[0] == [("r2", 4, 5, True)]
    assert h.holder_blocks("s") == [0, 3, 4]  # fresh blocks first; 1 and 2 wait in the free queue
    assert h.sessions.close("s")
    h.assert_all_free()


def test_after_a_fault_a_turn_waiting_for_its_session_recomputes_the_history():
    """drop_all_kv (a model step failed) also drops the blocks of a busy session whose turn waits to
    be admitted: the failed step may have written that history's last token."""
    h = Harness()
    h.add_turn("s", "r1", U1, start=True)
    h.run()
    h.add_turn("s", "r2", U2)  # waiting, not admitted yet
    assert h.holder_blocks("s") == [0, 1]
    h.sched.kv_cache.reset_prefix_cache()  # as engine/engine_core/faults.py does
    h.sessions.drop_all_kv()
    h.check()
    assert h.holder_blocks("s") == [] and h.sessions.get("s").num_kv_tokens == 0
    assert h.run()[0] == [("r2", 0, 11, True)]  # the whole history again (the fake model's KV is fresh)
    assert h.sessions.get("s").token_ids == U1 + expected_outputs("r1", 3) + U2 + expected_outputs("r2", 3)
    assert h.sessions.close("s")
    h.assert_all_free()


def test_a_stop_that_empties_a_short_first_turns_blocks_leaves_the_holder_nothing():
    """A 2-token first turn stopped after 1 output token while the core had 6 tokens (block 0 full
    and registered): the kept 3 tokens' block is given up, so the session holds no table at all
    (an empty one made the next turn's hand-over assert and killed the core)."""
    h = Harness()
    h.add_turn("s", "r1", [11, 12], max_tokens=6, start=True)
    run_steps(h, 4)
    stop_at(h, "r1", 1)
    assert not h.sched.kv_cache.holds(h.sessions.get("s").holder)
    assert h.sessions.get("s").num_kv_tokens == 0
    h.add_turn("s", "r2", U2)
    assert h.run()[0] == [("r2", 0, 5, True)]  # the 3-token history again, and the 2 new tokens
    assert h.holder_blocks("s") == [2, 3]  # fresh blocks; 0 (still a cache entry) and 1 wait
    assert h.sessions.close("s")
    h.assert_all_free()


def test_a_stop_found_after_the_core_ended_the_turn_cuts_the_history_there():
    """The core ended turn 1 by its length (6 output tokens) before the stub's stop string (at
    output token 2) reached it: the history is cut to 6 + 2 tokens, block 2 given back."""
    h = Harness()
    h.add_turn("s", "r1", U1, max_tokens=6, start=True)
    h.run()
    assert h.holder_blocks("s") == [0, 1, 2] and h.sessions.get("s").num_kv_tokens == 11
    h.sessions.stop_last_turn("r1", 2)
    h.check()
    session = h.sessions.get("s")
    assert session.token_ids == U1 + expected_outputs("r1", 2)
    assert session.num_kv_tokens == 8 and len(session.block_hashes) == 2
    assert h.holder_blocks("s") == [0, 1]
    h.add_turn("s", "r2", U2)
    h.sessions.stop_last_turn("r1", 0)  # one for the turn before, once the next began: nothing
    assert h.run()[0] == [("r2", 8, 2, True)]
    assert h.sessions.close("s")
    h.assert_all_free()
