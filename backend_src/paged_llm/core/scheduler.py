"""Continuous batching under a per-step token budget, with chunked prefill and preemption by recompute.

Each step:
  1. Running sequences that decode (they lack one token), best (priority, arrival) first, get it.
     When the pool is short, the worst running sequence not scheduled yet is preempted (its blocks
     freed; it is recomputed on resume).
  2. Running sequences still computing their prompt (a chunked prefill, a preempted sequence's
     recompute), best first, get what they lack, capped by the budget the decodes left. Short of
     blocks, such a chunk preempts the worst running prompt (maybe itself), never a decode.
  3. If nothing was preempted, waiting sequences are admitted in (priority, arrival) order, served
     first from the prefix cache, while the budget, `max_num_seqs` and the pool allow.
Decodes first is vLLM's chunked-prefill policy: a long prompt computed in chunks never makes the
streams that arrived after it (or rank below it) miss a step.
While any sequence is decoding, prefill (chunks of running sequences and admissions) takes at most
`max_prefill_tokens_while_decoding` tokens of a step (0: no separate limit), which bounds how long
decoding streams wait for a step when big prompts arrive.
When the runner launched the step, `on_launched` counts its tokens as computed and gives each sequence
that samples a pending token (a placeholder: the value is still on the device). After the step ran,
`update_from_output` writes the sampled values, registers newly full blocks in the prefix cache and
finishes sequences. With asynchronous scheduling the next step is scheduled between the two: a
decode then reads the pending token as its input (the runner takes it from the previous step's
output on the device), and a sequence whose pending token is its last (max_tokens, max_model_len)
is not scheduled again.
With speculative decoding a decoding sequence may bring proposed tokens (`seq.spec_token_ids`): the
step then computes its last token and up to k proposals (as many as the budget and its length limits
allow). `on_launched` counts only the last token as computed; `update_from_output` takes the tokens
the verification emitted (the accepted proposals plus one) and counts the accepted proposals too.
The KV written for rejected ones is never counted, and later steps overwrite it:

    before:  tokens [.. t]         computed up to t-1     step: t d1 d2 d3 (3 proposals)
    after:   tokens [.. t d1 e]    computed up to d1      (d1 accepted, d2 rejected, e emitted)
"""

from __future__ import annotations

import bisect
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from paged_llm.config import SchedulerConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.stop_rules import (
    accept_grammar_tokens,
    apply_verified,
    check_stop,
    reaches_length_limit,
)
from paged_llm.sequence import GrammarTokens, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence  # the live sequence (the runner reads its tokens and sampling params)
    num_computed_tokens: int  # tokens with KV before this step = position of the first new token
    num_new_tokens: int  # tokens computed this step: all_token_ids[start : start + num_new_tokens]
    block_ids: list[int]  # the sequence's whole block table (live view; read before the next schedule)
    needs_sample: bool  # this chunk reaches the last known token, so the step samples a new one
    # Proposed tokens this step verifies (computed after the last known token; speculative decoding).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # in batch order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    preempted: list[Sequence] = field(default_factory=list)  # preempted during this schedule()
    launched: bool = False  # on_launched() counted its tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SequenceUpdate:
    """What a finished step did to one scheduled sequence."""

    seq: Sequence
    new_token_id: int | None  # the sampled token; None for a prefill chunk that sampled nothing
    # With speculative decoding: every token the step emitted, in order (new_token_id is the last).
    new_token_ids: list[int] | None = None


@dataclass
class SchedulerStats:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting (queued or preempted)
    kv_usage: float  # fraction of KV blocks held by sequences
    num_preemptions_total: int
    prefix_cache_queried_tokens: int  # prompt tokens looked up at admission
    prefix_cache_hit_tokens: int  # of those, served from the prefix cache
    prompt_tokens_computed: int = 0  # prompt tokens whose KV steps computed, since start
    # Speculative decoding, since start (vLLM's spec_decode counters):
    spec_num_drafts: int = 0  # sequence-steps that verified proposed tokens
    spec_num_draft_tokens: int = 0  # proposed tokens verified
    spec_num_accepted_tokens: int = 0  # of those, accepted
    # LoRA (the runner's device slots; EngineCore.scheduler_stats fills them in):
    lora_loads_total: int = 0  # adapters written into a slot, since start
    lora_evictions_total: int = 0  # of those, ones that replaced another adapter
    num_lora_slots_used: int = 0  # slots holding an adapter now


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # Without chunking a sequence must be (re)computed in one step: a prompt, or a preempted
            # sequence's prompt + output, longer than the budget could never be scheduled.
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled"
            )
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by schedule_key
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self._next_arrival_seq = 0
        self.num_preemptions_total = 0
        self._prefill_left = 0  # prefill tokens the step being scheduled may still take
        # Called when the pool is short, before anything is preempted or left waiting: frees KV that
        # no sequence uses (an idle session's, core/sessions.py); True if it freed anything.
        self.reclaim_kv: Callable[[], bool] = lambda: False
        # LoRA: the running batch holds sequences of at most this many adapters (the device's
        # slots); None: no adapters are served
        self.max_loras: int | None = None
        self.num_prompt_tokens_computed = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0

    # ----------------------------------------------------------------------------------- sequences
    def add_sequence(self, seq: Sequence) -> None:
        assert seq.seq_id not in self.sequences, f"duplicate seq id {seq.seq_id}"
        assert seq.num_prompt_tokens >= 1 and seq.num_tokens <= self.max_model_len
        if seq.arrival_seq < 0:
            seq.arrival_seq = self._next_arrival_seq
            self._next_arrival_seq += 1
        seq.status = SequenceStatus.WAITING
        self.sequences[seq.seq_id] = seq
        self._enqueue_waiting(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_sequences(self) -> bool:
        return bool(self.sequences)

    def finish_sequences(self, seq_ids: Iterable[str], status: SequenceStatus) -> list[Sequence]:
        """Ends sequences (abort, stop string, timeout, error, and a step's stop or length limit from
        core/stop_rules.py): frees their blocks, forgets them."""
        assert status.is_finished
        finished = []
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self._remove_waiting(seq)
            self._finish(seq, status)
            finished.append(seq)
        return finished

    def truncate_output(self, seq: Sequence, num_output_tokens: int) -> None:
        """Drops the output tokens after the first `num_output_tokens`, and their KV (a stop string
        ended a session's turn there while the core had run further: the history keeps only what
        the client got). Call just before the sequence finishes."""
        seq.drop_pending_tokens()
        num_extra = seq.num_output_tokens - num_output_tokens
        if num_extra <= 0:
            return
        del seq.output_token_ids[-num_extra:]
        del seq.all_token_ids[-num_extra:]
        del seq.block_hashes[seq.num_tokens // self.kv_cache.block_size_tokens :]
        num_usable_tokens = seq.num_tokens
        if self.kv_cache.holds(seq.seq_id):
            num_usable_tokens = self.kv_cache.truncate(seq.seq_id, seq.num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_usable_tokens)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.drop_pending_tokens()
        seq.status = status
        completed = status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH)
        if seq.keep_kv_owner is not None and completed and self.kv_cache.holds(seq.seq_id):
            self.kv_cache.hand_over(seq.seq_id, seq.keep_kv_owner)
        else:
            self.kv_cache.free(seq)
        del self.sequences[seq.seq_id]

    # ----------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.schedule_key)
        # While sequences are decoding, prefill gets at most max_prefill_tokens_while_decoding of the
        # step, so one big prompt cannot stretch the step every decoding stream waits for.
        cap = self.config.max_prefill_tokens_while_decoding
        capped = (
            cap > 0
            and self.config.enable_chunked_prefill
            and any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        )
        self._prefill_left = cap if capped else budget
        # Decodes first (vLLM's chunked-prefill policy): every decoding sequence gets its token
        # before any prompt chunk does, so a long prompt being prefilled never stalls the streams
        # that arrived after it; running prompts' chunks take what the decodes left, then admissions.
        budget = self._schedule_running(output, budget, decodes=True)
        budget = self._schedule_running(output, budget, decodes=False)

        if not output.preempted:
            budget = self._admit_waiting(output, budget)
        output.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int, decodes: bool) -> int:
        """Schedules the running sequences that decode (`decodes`) or that prefill, best first;
        returns the budget left. Short of blocks, a decode preempts the worst running sequence not
        scheduled yet, a prompt chunk the worst running prompt: either one itself, if it is the
        worst (a decode scheduled in this step keeps its blocks)."""
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            lacking = seq.num_tokens - seq.num_computed_tokens
            assert lacking > 0, f"running seq {seq.seq_id} has nothing to compute"
            if (lacking == 1) != decodes:
                index += 1
                continue
            if seq.num_pending_tokens and reaches_length_limit(
                seq, seq.num_output_tokens, self.max_model_len
            ):
                index += 1  # its pending token is its last: it ends when that token arrives
                continue
            num_drafts = self._num_drafts_to_verify(seq, budget - 1) if lacking == 1 else 0
            num_new = 1 + num_drafts if lacking == 1 else min(lacking, budget, self._prefill_left)
            if num_new == 0:  # a prefill chunk, and the step's prefill share is spent
                index += 1
                continue
            while self.kv_cache.allocate_slots(seq, num_new) is None:
                if num_drafts:  # verify nothing rather than preempt or reclaim for proposals
                    num_drafts, num_new = 0, 1
                    continue
                if self.reclaim_kv():
                    continue
                # running[index:] is sorted best first and holds no decode scheduled this step;
                # prompt chunks go after every decode, so they take a victim among prompts only.
                victim = self.running[-1] if decodes else self._worst_prompt_from(index)
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; running[index] is now the next seq
            drafts = seq.spec_token_ids[:num_drafts]
            self._add_scheduled(output, seq, seq.num_computed_tokens, num_new, drafts)
            budget -= num_new
            if lacking > 1:
                self._prefill_left -= num_new
            index += 1
        return budget

    def _worst_prompt_from(self, index: int) -> Sequence:
        """The worst running sequence at or after `index` that is computing its prompt (there is
        one: running[index] is)."""
        return next(s for s in reversed(self.running[index:]) if s.num_tokens - s.num_computed_tokens > 1)

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> int:
        # waiting[:index]: sequences held back because their LoRA adapter has no slot (max_loras
        # adapters run already). Base-model sequences go past them; sequences of any adapter do
        # not, so the running adapters drain and a slot frees up (no adapter waits for ever).
        index = 0
        while index < len(self.waiting) and budget > 0:
            seq = self.waiting[index]
            if seq in output.preempted:
                break  # preempted this very step to make room: resuming it now would only thrash
            if not self._adapter_fits(seq) or (index and seq.sampling_params.lora_name is not None):
                index += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                budget, made_room = self._preempt_lower_priority(seq, output, budget)
                if not made_room:
                    break
                continue
            held = seq.held_kv_owner is not None and self.kv_cache.holds(seq.held_kv_owner)
            if held:  # a session's turn: its history's KV, partial last block included
                hit_blocks, num_hit_tokens = [], seq.num_held_kv_tokens
            else:
                hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(seq)
            num_new = seq.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget) if num_new == 1 else min(num_new, budget, self._prefill_left)
            if num_new == 0:
                break
            if not self._allocate_for_admission(seq, num_new, hit_blocks, held):
                if self.reclaim_kv():
                    continue
                # FCFS: the head waits for blocks rather than being overtaken, unless it outranks a
                # running seq.
                budget, made_room = self._preempt_lower_priority(seq, output, budget)
                if not made_room:
                    break
                continue
            self.waiting.pop(index)
            seq.held_kv_owner = None  # taken (or gone): a resume after preemption recomputes
            if not held:
                seq.num_held_kv_tokens = 0  # what it took from its session (reported once it ends)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_hit_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_prompt_tokens = num_hit_tokens
            self.running.append(seq)
            self._add_scheduled(output, seq, num_hit_tokens, num_new)
            budget -= num_new
            if num_new > 1:
                self._prefill_left -= num_new
        return budget

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Running `seq` keeps the batch within max_loras adapters."""
        name = seq.sampling_params.lora_name
        if name is None or self.max_loras is None:
            return True
        running = {s.sampling_params.lora_name for s in self.running} - {None}
        return name in running or len(running) < self.max_loras

    def _allocate_for_admission(self, seq: Sequence, num_new: int, hit_blocks: list, held: bool) -> bool:
        if not held:
            return self.kv_cache.allocate_slots(seq, num_new, hit_blocks) is not None
        assert seq.held_kv_owner is not None
        self.kv_cache.hand_over(seq.held_kv_owner, seq.seq_id)
        seq.num_computed_tokens = seq.num_held_kv_tokens
        if self.kv_cache.allocate_slots(seq, num_new) is not None:
            return True
        self.kv_cache.hand_over(seq.seq_id, seq.held_kv_owner)  # the holder keeps them while it waits
        seq.num_computed_tokens = 0
        return False

    def _preempt_lower_priority(
        self, seq: Sequence, output: SchedulerOutput, budget: int
    ) -> tuple[int, bool]:
        """Preempts the worst running sequence if `seq` strictly outranks it (lower priority value).

        The victim may already be scheduled in this step: it is taken out of the step and its tokens
        go back to the budget. (Its blocks hold no cache entries yet for this step's tokens: those are
        registered only after a step ran.) Returns the new budget and whether room was made.
        """
        candidates = [r for r in self.running if r.priority > seq.priority]
        if not candidates:
            return budget, False
        victim = max(candidates, key=lambda r: r.schedule_key)
        for position, item in enumerate(output.scheduled):
            if item.seq is victim:
                budget += item.num_new_tokens
                del output.scheduled[position]
                break
        self._preempt(victim)
        output.preempted.append(victim)
        return budget, True

    def _add_scheduled(
        self,
        output: SchedulerOutput,
        seq: Sequence,
        start: int,
        num_new: int,
        drafts: list[int] | None = None,
    ) -> None:
        self.num_prompt_tokens_computed += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
        num_drafts = len(drafts) if drafts else 0
        output.scheduled.append(
            ScheduledSequence(
                seq=seq,
                num_computed_tokens=start,
                num_new_tokens=num_new,
                block_ids=self.kv_cache.block_ids_view(seq.seq_id),
                needs_sample=start + num_new - num_drafts == seq.num_tokens,
                draft_token_ids=drafts or [],
            )
        )
        seq.spec_token_ids = []  # taken (or dropped): the proposer proposes afresh for the next step

    def _num_drafts_to_verify(self, seq: Sequence, room_tokens: int) -> int:
        """How many of a decoding sequence's proposed tokens this step verifies: no more than the
        step's budget has room for, nor than could still be emitted before max_tokens or
        max_model_len (a step emits the accepted proposals plus one token)."""
        if not seq.spec_token_ids or seq.num_pending_tokens:
            return 0
        limit = min(len(seq.spec_token_ids), room_tokens, self.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens - 1)
        return max(limit, 0)

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free the KV, keep every token, resume from scratch later."""
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue_waiting(seq)

    def _enqueue_waiting(self, seq: Sequence) -> None:
        # O(log n) keys read, not n: a flood of arrivals made the list of keys quadratic.
        bisect.insort_right(self.waiting, seq, key=operator.attrgetter("schedule_key"))

    def _remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)

    # ------------------------------------------------------------------------------------ update
    def on_launched(self, output: SchedulerOutput) -> None:
        """The step is on the device: its tokens count as computed (the KV a later step reads is
        written before it, in stream order), and each sequence that samples gets a pending token."""
        assert not output.launched, "on_launched twice for one step"
        output.launched = True
        for scheduled in output.scheduled:
            seq = scheduled.seq
            if seq.is_finished:
                continue  # aborted since schedule()
            # Proposals count once verified (update_from_output): until then only the last token.
            seq.num_computed_tokens += scheduled.num_new_tokens - len(scheduled.draft_token_ids)
            if scheduled.needs_sample:
                seq.append_pending_token()

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int],
        spec_token_ids: Mapping[str, list[int]] | None = None,
        defer_grammar_tokens: bool = False,
    ) -> list[SequenceUpdate]:
        """Applies a finished step: one update per scheduled sequence still live. `spec_token_ids`:
        for each sequence that verified proposals, the tokens the verification emitted.
        `defer_grammar_tokens`: the constrained sequences that sampled one token leave it for their
        grammars to take elsewhere (sampled_grammar_tokens: on the bitmask's fill thread); this
        reads no grammar then.

        Sequences that finished here (EOS, stop token, max_tokens, max_model_len: core/stop_rules.py)
        are already freed.
        """
        if not output.launched:
            self.on_launched(output)
        grammar_seqs = _sampled_grammar_seqs(output)
        if defer_grammar_tokens:
            deferred_ids = {seq.seq_id for seq in grammar_seqs}
            grammar_accepted: dict[str, bool] = {}
        else:
            deferred_ids = set()
            tokens = [sampled_token_ids[seq.seq_id] for seq in grammar_seqs]
            grammar_accepted = accept_grammar_tokens(grammar_seqs, tokens)
        updates: list[SequenceUpdate] = []
        for scheduled in output.scheduled:
            seq = scheduled.seq
            if seq.is_finished:
                continue  # finished between schedule() and now (abort); nothing to apply
            if not scheduled.needs_sample:
                self.kv_cache.cache_computed_blocks(seq)
                updates.append(SequenceUpdate(seq, None))
                continue
            new_token_ids = None
            if scheduled.draft_token_ids:
                assert spec_token_ids is not None, f"{seq.seq_id}: proposals verified, no result"
                first_new = seq.num_output_tokens - seq.num_pending_tokens
                drafts, emitted = scheduled.draft_token_ids, spec_token_ids[seq.seq_id]
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += len(drafts)
                self.spec_num_accepted_tokens += len(emitted) - 1
                status = apply_verified(seq, drafts, emitted, self.max_model_len)
                new_token_ids = seq.output_token_ids[first_new:]
                token_id = new_token_ids[-1]
            else:
                token_id = sampled_token_ids[seq.seq_id]
                num_output_tokens = seq.resolve_pending_token(token_id) + 1
                status = check_stop(
                    seq,
                    token_id,
                    num_output_tokens,
                    self.max_model_len,
                    grammar_accepted.get(seq.seq_id),
                    grammar_deferred=seq.seq_id in deferred_ids,
                )
            self.kv_cache.cache_computed_blocks(seq)
            if status is not None:
                # Running, or preempted while this step ran (asynchronous scheduling): it ends either way.
                self.finish_sequences([seq.seq_id], status)
            updates.append(SequenceUpdate(seq, token_id, new_token_ids))
        return updates

    # ------------------------------------------------------------------------------------- state
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv_cache.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queried_tokens=self.kv_cache.num_prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv_cache.num_prefix_hit_tokens,
            prompt_tokens_computed=self.num_prompt_tokens_computed,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
        )

    def check_integrity(self, kv_holders: Iterable[str] = ()) -> None:
        """`kv_holders`: owners of blocks other than running sequences (idle sessions)."""
        self.kv_cache.check_integrity()
        running_ids = {r.seq_id for r in self.running}
        waiting_ids = {r.seq_id for r in self.waiting}
        assert len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting)
        assert not running_ids & waiting_ids, "a seq is both running and waiting"
        assert running_ids | waiting_ids == set(self.sequences), "registry out of sync with the queues"
        owners = set(self.kv_cache.seq_to_blocks)
        assert owners <= running_ids | set(kv_holders), "a non-running seq holds blocks"
        keys = [r.schedule_key for r in self.waiting]
        assert keys == sorted(keys), "waiting queue out of order"
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens <= seq.num_tokens <= self.max_model_len
            num_blocks = len(self.kv_cache.seq_to_blocks.get(seq.seq_id, []))
            assert num_blocks >= self.kv_cache.num_blocks_for_tokens(seq.num_computed_tokens)
        for seq in self.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert seq.num_computed_tokens == 0


def _sampled_grammar_seqs(output: SchedulerOutput) -> list[Sequence]:
    """The step's constrained sequences that sampled one token (no proposals: those take theirs in
    apply_verified), whose grammars take it in one call (core/stop_rules.py accept_grammar_tokens)."""
    return [
        scheduled.seq
        for scheduled in output.scheduled
        if scheduled.seq.grammar is not None
        and scheduled.needs_sample
        and not scheduled.draft_token_ids
        and not scheduled.seq.is_finished
    ]


def sampled_grammar_tokens(output: SchedulerOutput, sampled_token_ids: Mapping[str, int]) -> GrammarTokens:
    """The tokens a step's constrained sequences sampled (one each, no proposals), for their grammars
    to take off the engine's thread (update_from_output(defer_grammar_tokens=True)); `ending` marks
    the EOS tokens, on which a grammar ends (the sampler allows an EOS only where one may end)."""
    tokens = GrammarTokens()
    for seq in _sampled_grammar_seqs(output):
        assert seq.grammar is not None
        token_id = sampled_token_ids[seq.seq_id]
        tokens.grammars.append(seq.grammar)
        tokens.token_ids.append(token_id)
        tokens.ending.append(token_id in seq.eos_token_ids)
    return tokens
