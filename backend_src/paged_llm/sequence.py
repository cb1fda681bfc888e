"""Sequence: the engine's record of one sequence being generated.

A sequence has no "prefill" or "decode" phase. It has `num_tokens` (prompt + generated so far) and
`num_computed_tokens` (how many of those have KV in the cache). Each step the scheduler gives it some
of the difference; when the computed count reaches `num_tokens`, the step also samples a new token:

    all_token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]        num_tokens = 7
    KV in cache:    [ ## ## ## ## ## | ##    ]        num_computed_tokens = 6 -> next step computes o1
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from paged_llm.sampling_params import SamplingParams

PENDING_TOKEN = -1  # a sampled token whose value is still on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was freed and is recomputed on resume
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"  # cancelled by the client, timed out or shut down
    FINISHED_ERROR = "error"  # the engine failed while running it

    @property
    def is_finished(self) -> bool:
        # By value: an Enum member hashes in Python code, a str's hash is cached (read several
        # times per sequence and step)
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        """The vLLM-compatible finish_reason string (`stop`, `length`, `abort`), or None if unfinished."""
        if self is SequenceStatus.FINISHED_ERROR:
            return "abort"
        return self.value if self.is_finished else None


_FINISHED_VALUES = frozenset(
    status.value
    for status in (
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    )
)


class GrammarState(Protocol):
    """A constrained sequence's grammar (structured_output/grammar.py), as the scheduler sees it."""

    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id`; False if the grammar does not allow it (state unchanged)."""
        ...

    @staticmethod
    def accept_tokens(grammars: list[GrammarState], token_ids: list[int]) -> list[bool]:
        """accept_token for many grammars of this type at once, one token each."""
        ...

    def is_terminated(self) -> bool:
        """The grammar ended (on an EOS token): nothing more may follow."""
        ...

    def can_end(self) -> bool:
        """An EOS token is allowed now."""
        ...


@dataclass
class GrammarTokens:
    """Tokens that constrained sequences sampled and their grammars have not taken yet, one per
    grammar: a step's, handed to the thread that fills the next step's bitmask (`take_all`).
    `ending[i]`: token i ends its grammar (one of its sequence's EOS tokens)."""

    grammars: list[GrammarState] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    ending: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def take_all(self) -> None:
        """Advances each grammar by its token, in one call; raises GrammarRejectedToken if a grammar
        did not allow its token (its sampler masked the ones it does not allow: a bug)."""
        if not self.grammars:
            return
        accepted = type(self.grammars[0]).accept_tokens(self.grammars, self.token_ids)
        rejected = [token for token, ok in zip(self.token_ids, accepted, strict=True) if not ok]
        if rejected:
            raise GrammarRejectedToken(
                f"{len(rejected)} of {len(self.token_ids)} grammars did not allow the token sampled under "
                f"their mask (token ids {rejected[:8]})"
            )


class GrammarRejectedToken(RuntimeError):
    pass


def prefix_hash_root(lora_name: str | None, lora_load_id: int = 0) -> bytes:
    """The prefix-cache hash chain's root for sequences of this adapter (None: the base model), as
    loaded the `lora_load_id`-th time (lora/manager.py load_id: an adapter loaded again under a
    name never meets the KV of the weights it had before)."""
    if lora_name is None:
        return b"root"
    return b"lora\0" + lora_name.encode() + b"\0" + str(lora_load_id).encode()


@dataclass(eq=False)
class Sequence:
    seq_id: str  # unique within the engine
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved 64-bit sampling seed (drawn by the engine when the client gave none)
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS ids (generation_config)
    arrival_time: float = 0.0  # seconds (time.monotonic) when the engine accepted it
    deadline: float | None = None  # time.monotonic() after which it is aborted (Triton's timeout)
    arrival_seq: int = -1  # admission order, assigned by the scheduler; kept across preemptions
    lora_load_id: int = 0  # which load of its LoRA adapter it runs with (prefix_hash_root)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens of all_token_ids whose KV is in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block
    first_scheduled_time: float | None = None
    num_pending_tokens: int = 0  # placeholders at the end of all_token_ids (asynchronous scheduling)
    # A session's turn (core/sessions.py): at admission it takes the blocks that `held_kv_owner`
    # holds for its first `num_held_kv_tokens` tokens instead of looking up the prefix cache; when
    # it finishes (stop or length) its blocks go to `keep_kv_owner` instead of back to the pool.
    # After admission num_held_kv_tokens is what it did take (0: the holder had lost them).
    held_kv_owner: str | None = None
    num_held_kv_tokens: int = 0
    keep_kv_owner: str | None = None
    # Speculative decoding (spec_decode/): the tokens proposed for its next step (the scheduler
    # takes them into that step), and the proposer's own state for this sequence.
    spec_token_ids: list[int] = field(default_factory=list)
    proposer_state: object | None = None
    spec_pause: object | None = None  # spec_decode.proposer.SpeculationPause
    # Structured output: the grammar the sequence's tokens follow (None: unconstrained). Advanced by
    # the stop rules with each token; the sampler masks what it does not allow.
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def schedule_key(self) -> tuple[int, int]:
        """Lower runs sooner: priority first, then arrival order (FCFS)."""
        return (self.priority, self.arrival_seq)

    @property
    def hash_root(self) -> bytes:
        """The parent of its first block's prefix-cache hash: the KV of a prompt under a LoRA
        adapter differs from the base model's and from every other adapter's."""
        return prefix_hash_root(self.sampling_params.lora_name, self.lora_load_id)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are on the host (all but the pending ones at the end)."""
        return len(self.all_token_ids) - self.num_pending_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_pending_token(self) -> None:
        self.append_output_token(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int) -> int:
        """Gives the oldest pending token its value; returns that token's index in output_token_ids."""
        assert self.num_pending_tokens > 0, f"{self.seq_id}: no pending token to resolve"
        index = len(self.output_token_ids) - self.num_pending_tokens
        self.output_token_ids[index] = token_id
        self.all_token_ids[self.num_prompt_tokens + index] = token_id
        self.num_pending_tokens -= 1
        return index

    def drop_pending_tokens(self) -> None:
        """Forgets the placeholders (the sequence ended before their steps finished)."""
        if self.num_pending_tokens:
            del self.output_token_ids[-self.num_pending_tokens :]
            del self.all_token_ids[-self.num_pending_tokens :]
            self.num_pending_tokens = 0
