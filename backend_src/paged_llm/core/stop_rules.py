"""The scheduler's output side: applying a finished step's sampled (or verified) tokens to its
sequences, and the rules that end a sequence (EOS, stop token, max_tokens, max_model_len).

`Scheduler.update_from_output` delegates here. Status changes stay the scheduler's: a sequence that
ends is finished through `Scheduler.finish_sequences`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_llm.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from paged_llm.core.scheduler import Scheduler, SchedulerOutput


@dataclass
class SequenceUpdate:
    """What a finished step did to one scheduled sequence."""

    seq: Sequence
    new_token_id: int | None  # the sampled token; None for a prefill chunk that sampled nothing
    # With speculative decoding: every token the step emitted, in order (new_token_id is the last).
    new_token_ids: list[int] | None = None


def update_from_output(
    scheduler: Scheduler,
    output: SchedulerOutput,
    sampled_token_ids: Mapping[str, int],
    spec_token_ids: Mapping[str, list[int]] | None = None,
) -> list[SequenceUpdate]:
    """Applies a finished step: one update per scheduled sequence still live. `spec_token_ids`:
    for each sequence that verified proposals, the tokens the verification emitted.

    Sequences that finished here (EOS, stop token, max_tokens, max_model_len) are already freed.
    """
    if not output.launched:
        scheduler.on_launched(output)
    updates: list[SequenceUpdate] = []
    for scheduled in output.scheduled:
        seq = scheduled.seq
        if seq.is_finished:
            continue  # finished between schedule() and now (abort); nothing to apply
        if not scheduled.needs_sample:
            scheduler.kv_cache.cache_computed_blocks(seq)
            updates.append(SequenceUpdate(seq, None))
            continue
        new_token_ids = None
        if scheduled.draft_token_ids:
            assert spec_token_ids is not None, f"{seq.seq_id}: proposals verified, no result"
            first_new = seq.num_output_tokens - seq.num_pending_tokens
            status = _apply_verified(scheduler, seq, scheduled.draft_token_ids, spec_token_ids[seq.seq_id])
            new_token_ids = seq.output_token_ids[first_new:]
            token_id = new_token_ids[-1]
        else:
            token_id = sampled_token_ids[seq.seq_id]
            num_output_tokens = seq.resolve_pending_token(token_id) + 1
            status = _check_stop(seq, token_id, num_output_tokens, scheduler.max_model_len)
        scheduler.kv_cache.cache_computed_blocks(seq)
        if status is not None:
            # Running, or preempted while this step ran (asynchronous scheduling): it ends either way.
            scheduler.finish_sequences([seq.seq_id], status)
        updates.append(SequenceUpdate(seq, token_id, new_token_ids))
    return updates


def _apply_verified(
    scheduler: Scheduler, seq: Sequence, drafts: list[int], emitted: list[int]
) -> SequenceStatus | None:
    """Appends the tokens a verification emitted (the accepted proposals, then one token), up to
    the first that ends the sequence, and counts the accepted proposals' KV as computed (the
    rejected ones' KV is stale; later steps overwrite it). Returns the status that ended it."""
    num_accepted = len(emitted) - 1
    assert 0 <= num_accepted <= len(drafts) and emitted[:num_accepted] == drafts[:num_accepted]
    scheduler.spec_num_drafts += 1
    scheduler.spec_num_draft_tokens += len(drafts)
    scheduler.spec_num_accepted_tokens += num_accepted
    seq.num_computed_tokens += num_accepted
    status = None
    for position, token_id in enumerate(emitted):
        if position == 0:
            num_output_tokens = seq.resolve_pending_token(token_id) + 1
        else:
            seq.append_output_token(token_id)
            num_output_tokens = seq.num_output_tokens
        status = _check_stop(seq, token_id, num_output_tokens, scheduler.max_model_len)
        if status is not None:
            break
    # Ended early: the KV of the accepted proposals it keeps is valid, the rest is not its.
    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
    return status


def _check_stop(
    seq: Sequence, token_id: int, num_output_tokens: int, max_model_len: int
) -> SequenceStatus | None:
    """Whether output token number `num_output_tokens` (1-based), `token_id`, ends the sequence."""
    params = seq.sampling_params
    # Stop tokens count from index min_tokens on (the sampler suppresses them before that).
    if num_output_tokens > params.min_tokens:
        if token_id in seq.eos_token_ids and not params.ignore_eos:
            seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
    if reaches_length_limit(seq, num_output_tokens, max_model_len):
        return SequenceStatus.FINISHED_LENGTH
    return None


def reaches_length_limit(seq: Sequence, num_output_tokens: int, max_model_len: int) -> bool:
    """Whether `num_output_tokens` output tokens reach max_tokens or max_model_len. The scheduler
    also asks it for a sequence's pending token (its last: it is not scheduled again)."""
    max_tokens = seq.sampling_params.max_tokens
    if max_tokens is not None and num_output_tokens >= max_tokens:
        return True
    return seq.num_prompt_tokens + num_output_tokens >= max_model_len
