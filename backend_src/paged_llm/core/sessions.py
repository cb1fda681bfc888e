"""Sessions: multi-turn conversations whose KV stays with them between turns. Pure Python (no torch).

A session owns its conversation's token ids and, between turns, the KV blocks of them (in the KV
cache manager, under the session's holder key). A turn is an ordinary sequence whose prompt is the
history plus the turn's new tokens; at admission it takes the session's blocks (partial last block
included), so only the new tokens are computed, and when it finishes (stop or length) it gives its
blocks back with the longer history:

    turn 1:  prompt [u1 u1 u1]            -> output [a1 a1]       history [u1 u1 u1 a1 a1]
    turn 2:  prompt [u1 u1 u1 a1 a1 u2 u2] (KV of the first 4 held; a1's last token has none yet)

An idle session's KV is reclaimed first when the pool runs short (least recently used first): its
full blocks stay in the prefix cache, the rest is recomputed by its next turn. An aborted or failed
turn leaves the history as it was (its KV is freed with it). A session idle for `session_idle_ttl_s` is
closed; its id is then unknown (NOT_FOUND).

History truncation with attention sinks: a turn that would not fit the session window (its prompt
plus room for max_tokens) keeps the history's first `num_sink_tokens` and the most recent tokens
that fit; the kept tokens are recomputed at their new positions, so the turn equals a fresh request
on the truncated history.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from paged_llm.config import SessionConfig
from paged_llm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from paged_llm.errors import InvalidRequestError, QueueFullError, SessionNotFoundError
from paged_llm.sequence import Sequence, SequenceStatus, prefix_hash_root

HOLDER_PREFIX = "\0session:"  # holder keys never collide with sequence ids (request ids)


@dataclass(frozen=True)
class SessionTurn:
    """The session fields of a request: which session, and whether it opens or closes it."""

    session_id: str
    start: bool = False  # open the session with this turn (an open one is an error)
    end: bool = False  # close it once this turn ended

    def closes_only(self, new_token_ids: list[int]) -> bool:
        """A request that ends the session with no new tokens: closed at once, nothing generated."""
        return self.end and not new_token_ids


@dataclass
class Session:
    session_id: str
    token_ids: list[int]  # the conversation so far: every turn's input and output
    num_kv_tokens: int = 0  # leading token_ids whose KV the session holds (0: none, or evicted)
    last_used: float = 0.0  # time.monotonic() of the last turn's start or end
    turn_request_id: str | None = None  # the turn in flight, if any
    closing: bool = False  # the turn in flight ends the session
    # Prefix-cache hashes of token_ids' leading full blocks (core/kv_cache_manager.py): the next
    # turn's sequence starts from them and hashes only its new blocks (re-hashing a 4,400-token
    # history every turn was O(history) on the way to the first token).
    block_hashes: list[bytes] = field(default_factory=list)
    # (request id, prompt tokens) of the turn that last extended token_ids, until the next begins:
    # a stop string the stub finds in it after the core ended it cuts the history there
    last_turn: tuple[str, int] | None = None
    lora_name: str | None = None  # the adapter of its first turn: every turn runs with it
    lora_load_id: int = 0  # the load of it the last turn ran with (Sequence.lora_load_id)

    @property
    def holder(self) -> str:
        return HOLDER_PREFIX + self.session_id


@dataclass
class SessionStats:
    num_open: int
    num_holding_kv: int  # sessions whose KV is held between turns
    num_evicted_total: int  # KV of an idle session reclaimed for other work
    num_expired_total: int  # closed after session_idle_ttl_s
    num_truncated_total: int  # turns whose history was truncated
    reused_tokens_total: int  # tokens whose KV a turn took from its session instead of computing


@dataclass
class PreparedTurn:
    prompt_token_ids: list[int]  # history (truncated if needed) + the turn's new tokens
    num_dropped_tokens: int  # history tokens dropped by truncation (0: none)


def truncate_with_sinks(
    history: list[int], new_token_ids: list[int], max_prompt_tokens: int, num_sink_tokens: int
) -> tuple[list[int], int]:
    """history + new, cut to `max_prompt_tokens` by dropping history after its first
    `num_sink_tokens`; returns (tokens, number dropped). ValueError if the new tokens and the sinks
    alone do not fit."""
    combined = history + new_token_ids
    if len(combined) <= max_prompt_tokens:
        return combined, 0
    num_sinks = min(num_sink_tokens, len(history))
    num_recent = max_prompt_tokens - num_sinks
    if num_recent < len(new_token_ids):
        raise ValueError(
            f"the turn's {len(new_token_ids)} new tokens and {num_sinks} sink tokens do not fit in "
            f"{max_prompt_tokens} prompt tokens"
        )
    return combined[:num_sinks] + combined[len(combined) - num_recent :], len(combined) - max_prompt_tokens


class SessionManager:
    def __init__(
        self,
        config: SessionConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.window_tokens = min(config.session_window_tokens or max_model_len, max_model_len)
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.num_evicted_total = 0
        self.num_expired_total = 0
        self.num_truncated_total = 0
        self.reused_tokens_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    # ----------------------------------------------------------------------------------- turns
    def begin_turn(
        self,
        turn: SessionTurn,
        request_id: str,
        new_token_ids: list[int],
        max_tokens: int | None,
        lora_name: str | None = None,
        lora_load_id: int = 0,
    ) -> PreparedTurn:
        """Checks the turn (errors name `session_id`, `lora_name` or the prompt) and marks the
        session busy. A session keeps its first turn's LoRA adapter (its KV was computed with it)."""
        session = self._sessions.get(turn.session_id)
        if turn.start:
            if session is not None:
                raise InvalidRequestError("session_id", f"session {turn.session_id!r} is already open")
            if len(self._sessions) >= self.config.max_sessions:
                raise QueueFullError(
                    f"{len(self._sessions)} sessions are open (max_sessions={self.config.max_sessions}); "
                    "close one or retry later"
                )
            session = Session(turn.session_id, [], lora_name=lora_name)
        elif session is None:
            raise SessionNotFoundError(turn.session_id)
        elif session.turn_request_id is not None:
            raise InvalidRequestError(
                "session_id",
                f"session {turn.session_id!r} already has a turn in flight (request "
                f"{session.turn_request_id!r}); send the next turn after it ended",
            )
        if session.lora_name != lora_name:
            raise InvalidRequestError(
                "lora_name",
                f"session {turn.session_id!r} runs with "
                + (f"LoRA adapter {session.lora_name!r}" if session.lora_name else "the base model")
                + f", not {lora_name!r}: every turn of a session uses its first turn's adapter",
            )
        room_for_output = max_tokens if max_tokens is not None else 1
        max_prompt_tokens = self.window_tokens - room_for_output
        try:
            prompt, num_dropped = truncate_with_sinks(
                session.token_ids, new_token_ids, max_prompt_tokens, self.config.num_sink_tokens
            )
        except ValueError as error:
            raise InvalidRequestError(
                "text_input", f"{error} (session window {self.window_tokens}, max_tokens {room_for_output})"
            ) from None
        if turn.start:
            self._sessions[turn.session_id] = session
        if num_dropped:  # positions change: the held KV is of no use (the history changes only
            self._drop_kv(session)  # when the turn completes: an aborted one leaves it whole)
            session.block_hashes = []  # hashes of the untruncated history: not the prompt's prefix
            self.num_truncated_total += 1
        if session.lora_load_id != lora_load_id:  # its adapter was loaded again since: other weights
            self._drop_kv(session)
            session.block_hashes = []
            session.lora_load_id = lora_load_id
        session.turn_request_id = request_id
        session.closing = turn.end
        session.last_turn = None
        self._touch(session)
        return PreparedTurn(prompt, num_dropped)

    def attach(self, session_id: str, seq: Sequence) -> None:
        """Sets up the turn's sequence to take the session's KV and to give its own back."""
        session = self._sessions[session_id]
        seq.keep_kv_owner = session.holder
        seq.block_hashes = list(session.block_hashes)  # the history is the prompt's prefix
        if session.num_kv_tokens and self.kv_cache.holds(session.holder):
            seq.held_kv_owner = session.holder
            seq.num_held_kv_tokens = session.num_kv_tokens

    def end_turn(self, session_id: str, seq: Sequence | None) -> None:
        """The turn's request is closed. A turn that stopped or hit its length extends the history
        (its blocks were handed to the session); any other end leaves the history as it was."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        session.turn_request_id = None
        completed = seq is not None and seq.status in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
        )
        if seq is not None and seq.held_kv_owner is None:  # admitted: it took what it says
            self.reused_tokens_total += seq.num_held_kv_tokens
        if completed and seq is not None:
            session.last_turn = (seq.seq_id, seq.num_prompt_tokens)
            session.token_ids = list(seq.all_token_ids)
            session.block_hashes = seq.block_hashes  # the sequence is done: it appends no more
            session.num_kv_tokens = (
                min(seq.num_computed_tokens, seq.num_tokens) if self.kv_cache.holds(session.holder) else 0
            )
        elif not self.kv_cache.holds(session.holder):
            session.num_kv_tokens = 0  # the turn took the KV and was aborted with it
        self._touch(session)
        if session.closing:
            self.close(session_id)

    # ------------------------------------------------------------------------------ lifecycle
    def close(self, session_id: str) -> bool:
        """Ends a session and frees its KV; False if it was not open."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._drop_kv(session)
        return True

    def expire_idle(self) -> list[str]:
        """Closes sessions idle for longer than session_idle_ttl_s; returns their ids."""
        if self.config.session_idle_ttl_s <= 0:
            return []
        deadline = self._clock() - self.config.session_idle_ttl_s
        expired = []
        for session in self._sessions.values():  # least recently used first
            if session.last_used > deadline:
                break
            if session.turn_request_id is None:
                expired.append(session.session_id)
        for session_id in expired:
            self.close(session_id)
        self.num_expired_total += len(expired)
        return expired

    def reclaim_idle_kv(self) -> bool:
        """Frees the KV of the least recently used idle session that holds any (the scheduler calls
        this when the pool is short); its history stays, and its next turn recomputes it. With no
        idle one, a session whose turn waits for admission gives up its KV: otherwise that turn,
        queued behind a sequence that needs the room, and that sequence would wait for each other.
        (An admitted turn holds its blocks itself, as a sequence.)"""
        holding = [s for s in self._sessions.values() if self.kv_cache.holds(s.holder)]
        idle = [s for s in holding if s.turn_request_id is None]
        for session in idle or holding:  # least recently used first
            self._drop_kv(session)
            self.num_evicted_total += 1
            return True
        return False

    def stop_last_turn(self, request_id: str, num_output_tokens: int) -> None:
        """A stop string ended turn `request_id` after `num_output_tokens` output tokens, and the
        core had already ended it further on (EOS or its length, a step or more ahead of the front
        end): the history keeps the tokens up to the stop, as when the stop arrives in time."""
        session = next(
            (s for s in self._sessions.values() if s.last_turn and s.last_turn[0] == request_id), None
        )
        if session is None or session.last_turn is None:
            return
        num_tokens = session.last_turn[1] + num_output_tokens
        if len(session.token_ids) <= num_tokens:
            return
        del session.token_ids[num_tokens:]
        del session.block_hashes[num_tokens // self.kv_cache.block_size_tokens :]
        if self.kv_cache.holds(session.holder):
            num_usable_tokens = self.kv_cache.truncate(session.holder, num_tokens)
            session.num_kv_tokens = min(session.num_kv_tokens, num_usable_tokens)
        else:
            session.num_kv_tokens = 0

    def drop_all_kv(self) -> None:
        """Forgets the KV every session holds (after a model fault its contents are not trusted):
        idle sessions, and busy ones whose turn waits to be admitted (the step that failed may have
        been writing their last turn's final token); a waiting turn then recomputes the history."""
        for session in self._sessions.values():
            if self.kv_cache.holds(session.holder):
                self._drop_kv(session)

    def forget_adapter(self, lora_name: str) -> None:
        """The sessions of an adapter being unloaded keep no KV or block hashes of it: a turn after
        the adapter is loaded again (under that name) recomputes the history."""
        for session in self._sessions.values():
            if session.lora_name == lora_name:
                if self.kv_cache.holds(session.holder):
                    self._drop_kv(session)
                session.block_hashes = []

    def _drop_kv(self, session: Session) -> None:
        self.kv_cache.free_owner(session.holder)
        session.num_kv_tokens = 0

    def _touch(self, session: Session) -> None:
        session.last_used = self._clock()
        self._sessions.move_to_end(session.session_id)

    # ---------------------------------------------------------------------------------- state
    @property
    def kv_holders(self) -> set[str]:
        return {s.holder for s in self._sessions.values()}

    def stats(self) -> SessionStats:
        return SessionStats(
            num_open=len(self._sessions),
            num_holding_kv=sum(1 for s in self._sessions.values() if self.kv_cache.holds(s.holder)),
            num_evicted_total=self.num_evicted_total,
            num_expired_total=self.num_expired_total,
            num_truncated_total=self.num_truncated_total,
            reused_tokens_total=self.reused_tokens_total,
        )

    def check_integrity(self) -> None:
        size = self.kv_cache.block_size_tokens
        for session in self._sessions.values():
            assert session.num_kv_tokens <= len(session.token_ids), f"{session.session_id}: KV past history"
            if self.kv_cache.holds(session.holder):
                assert session.turn_request_id is not None or session.num_kv_tokens > 0
                num_blocks = len(self.kv_cache.seq_to_blocks[session.holder])
                assert num_blocks * size >= session.num_kv_tokens, f"{session.session_id}: blocks short"
            assert len(session.block_hashes) * size <= len(session.token_ids), "hashes past history"
            parent = None
            root = prefix_hash_root(session.lora_name, session.lora_load_id)
            for index, block_hash in enumerate(session.block_hashes):
                tokens = session.token_ids[index * size : (index + 1) * size]
                parent = hash_block_tokens(parent, tokens, self.kv_cache.hash_salt, root)
                assert block_hash == parent, f"{session.session_id}: block {index}: hash differs"
        holders = {o for o in self.kv_cache.seq_to_blocks if o.startswith(HOLDER_PREFIX)}
        assert holders <= self.kv_holders, "a closed session still holds blocks"
