"""The rules that end a sequence (EOS, stop token, max_tokens, max_model_len), and appending a
verification's tokens up to the first that ends it.

Pure rules on one sequence (but `accept_grammar_tokens`, which advances a step's grammars in one
call): `Scheduler.update_from_output` applies a finished step with them and keeps the status changes
(a sequence that ends is finished through `Scheduler.finish_sequences`).
"""

from __future__ import annotations

from paged_llm.sequence import Sequence, SequenceStatus


def apply_verified(
    seq: Sequence, drafts: list[int], emitted: list[int], max_model_len: int
) -> SequenceStatus | None:
    """Appends the tokens a verification emitted (the accepted proposals, then one token), up to
    the first that ends the sequence, and counts the accepted proposals' KV as computed (the
    rejected ones' KV is stale; later steps overwrite it). Returns the status that ended it."""
    num_accepted = len(emitted) - 1
    assert 0 <= num_accepted <= len(drafts) and emitted[:num_accepted] == drafts[:num_accepted]
    seq.num_computed_tokens += num_accepted
    status = None
    for position, token_id in enumerate(emitted):
        if position == 0:
            num_output_tokens = seq.resolve_pending_token(token_id) + 1
        else:
            seq.append_output_token(token_id)
            num_output_tokens = seq.num_output_tokens
        status = check_stop(seq, token_id, num_output_tokens, max_model_len)
        if status is not None:
            break
    # Ended early: the KV of the accepted proposals it keeps is valid, the rest is not its.
    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
    return status


def check_stop(
    seq: Sequence,
    token_id: int,
    num_output_tokens: int,
    max_model_len: int,
    grammar_accepted: bool | None = None,
    grammar_deferred: bool = False,
) -> SequenceStatus | None:
    """Whether output token number `num_output_tokens` (1-based), `token_id`, ends the sequence.
    A constrained sequence's grammar takes the token first: a grammar that ended ends the sequence
    (EOS closes it, whatever min_tokens or ignore_eos say: nothing may follow), and a token it does
    not allow (a bug: the sampler masks those) ends it with an error. `grammar_accepted`: the
    grammar took the token already (accept_grammar_tokens), with this result. `grammar_deferred`:
    the grammar takes the token later (GrammarTokens.take_all); the token was sampled under its
    mask, which allows an EOS only where the grammar may end, so an EOS is what ends it."""
    params = seq.sampling_params
    grammar = seq.grammar
    if grammar is not None:
        if grammar_deferred:
            grammar_accepted = True
        elif grammar_accepted is None:
            grammar_accepted = grammar.accept_token(token_id)
        if not grammar_accepted:
            return SequenceStatus.FINISHED_ERROR
        ended = token_id in seq.eos_token_ids if grammar_deferred else grammar.is_terminated()
        if ended:
            seq.stop_reason = token_id if token_id in seq.eos_token_ids else None
            return SequenceStatus.FINISHED_STOPPED
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


def accept_grammar_tokens(seqs: list[Sequence], token_ids: list[int]) -> dict[str, bool]:
    """Advances the grammars of constrained `seqs` by one token each, in one call for the lot
    (GrammarState.accept_tokens); seq_id -> whether the grammar allowed its token, for check_stop."""
    grammars = [seq.grammar for seq in seqs if seq.grammar is not None]
    if not grammars:
        return {}
    assert len(grammars) == len(seqs), "accept_grammar_tokens takes constrained sequences only"
    assert all(type(grammar) is type(grammars[0]) for grammar in grammars), "one grammar type a step"
    accepted = type(grammars[0]).accept_tokens(grammars, token_ids)
    return {seq.seq_id: ok for seq, ok in zip(seqs, accepted, strict=True)}


def reaches_length_limit(seq: Sequence, num_output_tokens: int, max_model_len: int) -> bool:
    """Whether `num_output_tokens` output tokens reach max_tokens or max_model_len. The scheduler
    also asks it for a sequence's pending token (its last: it is not scheduled again)."""
    max_tokens = seq.sampling_params.max_tokens
    if max_tokens is not None and num_output_tokens >= max_tokens:
        return True
    return seq.num_prompt_tokens + num_output_tokens >= max_model_len
