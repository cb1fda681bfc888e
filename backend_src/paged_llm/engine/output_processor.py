"""The stub's per-request state: token ids from the engine core in, text deltas out.

For every request it keeps the n sequences' incremental detokenizers, stop-string matchers, logprob
text and what each produced since its last RequestOutput. A stop string that matches ends the
sequence here at once (its later tokens are dropped) and yields an AbortRequest for the core, which
is still generating it. A request is finished when all of its sequences are; the core's own end of
the request may arrive later and is then ignored.

The core knows each request by a `core_request_id` that is never reused (a counter), so a client
reusing a finished request's id can never receive the old request's late tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from paged_llm.engine.core_types import AbortRequest, CoreError, EngineCoreOutputs
from paged_llm.engine.outputs import PositionLogprobs, RequestOutput, SequenceDelta, TopLogprob
from paged_llm.engine.stats import EngineStats
from paged_llm.errors import (
    EngineStepError,
    InvalidRequestError,
    QueueFullError,
    RequestAbortedError,
    SessionNotFoundError,
)
from paged_llm.sampling.token_logprobs import TokenLogprobs
from paged_llm.sampling_params import SamplingParams
from paged_llm.tokenizer.detokenizer import IncrementalDetokenizer, decode_token


def error_from_core(error: CoreError) -> BaseException:
    """The typed error a CoreError stands for (errors.py maps each to a Triton status code)."""
    if error.kind == "invalid_arg":
        return InvalidRequestError(error.field or "request", error.message)
    if error.kind == "unavailable":
        return QueueFullError(error.message)
    if error.kind == "not_found":
        return SessionNotFoundError.with_message(error.message)
    if error.kind == "aborted":
        return RequestAbortedError(error.message)
    return EngineStepError(error.message)


def position_logprobs(tokenizer: Any, token_id: int, logprobs: TokenLogprobs) -> PositionLogprobs:
    top = [
        TopLogprob(tid, lp, rank + 1, decode_token(tokenizer, tid))
        for rank, (tid, lp) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs))
    ]
    return PositionLogprobs(
        token_id=token_id,
        logprob=logprobs.sampled_logprob,
        rank=logprobs.sampled_rank,
        decoded_token=decode_token(tokenizer, token_id),
        top=top,
    )


@dataclass
class _SequenceState:
    detokenizer: IncrementalDetokenizer
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # set when the sequence ended
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    reported_final: bool = False  # the delta carrying finish_reason was handed out
    last_token_time: float | None = None
    # Produced since this sequence's last delta.
    pending_text: list[str] = field(default_factory=list)
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_news(self) -> bool:
        return bool(
            self.pending_token_ids or self.pending_text or (self.finished and not self.reported_final)
        )


@dataclass
class RequestState:
    """One client request as the stub sees it."""

    request_id: str
    core_request_id: str  # the id the engine core knows it by (unique for the processor's lifetime)
    params: SamplingParams
    num_prompt_tokens: int
    sequences: list[_SequenceState]
    arrival_time: float
    first_token_time: float | None = None
    error: BaseException | None = None  # the request failed (or was aborted) with this
    history_truncated_tokens: int | None = None  # its session dropped these; reported on one output
    in_session: bool = False  # a session's turn: whether it extended the history is the core's to say

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        for seq in self.sequences:  # read twice a generated token: a loop beats all() on a generator
            if seq.finish_reason is None:
                return False
        return True

    @property
    def completed(self) -> bool:
        """Every sequence ended by a stop or its length (not by an abort or a fault)."""
        return self.error is None and all(s.finish_reason in ("stop", "length") for s in self.sequences)


class OutputProcessor:
    """Not thread-safe: the owner serialises calls (engine/async_llm.py holds a lock)."""

    def __init__(self, tokenizer: Any, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.stats = stats
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, RequestState] = {}
        self._core_ids = itertools.count()
        self.core_id_prefix = ""  # a core shared by several stubs routes outputs by it

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        in_session: bool = False,
    ) -> str:
        """Registers a request; returns the id to give the engine core."""
        if request_id in self.requests:
            raise InvalidRequestError("request id", f"{request_id!r} is already in flight")
        sequences = [
            _SequenceState(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            )
            for _ in range(params.n)
        ]
        state = RequestState(
            request_id,
            f"{self.core_id_prefix}{next(self._core_ids)}",
            params,
            len(prompt_token_ids),
            sequences,
            arrival_time,
            in_session=in_session,
        )
        self.requests[request_id] = state
        self._by_core_id[state.core_request_id] = state
        return state.core_request_id

    def remove_request(self, request_id: str) -> None:
        """Forgets a request the core never got (its submission failed)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            del self._by_core_id[state.core_request_id]

    def core_request_id(self, request_id: str) -> str | None:
        state = self.requests.get(request_id)
        return None if state is None else state.core_request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -------------------------------------------------------------------------------- core output
    def process(self, outputs: EngineCoreOutputs) -> tuple[set[str], list[AbortRequest]]:
        """Applies one core step; returns the (client) ids of the requests it touched and the aborts
        the core needs (sequences that a stop string ended here)."""
        now = time.monotonic()
        touched: set[str] = set()
        aborts: list[AbortRequest] = []
        ended = {(f.request_id, f.seq_index): f for f in outputs.finished_sequences}
        # A sequence has several rows when the step verified proposals (speculative decoding): its
        # end, if it ended, goes with its last row.
        last_rows = None
        if ended and len(set(zip(outputs.request_ids, outputs.seq_indices))) < outputs.num_rows:
            last_rows = {key: row for row, key in enumerate(zip(outputs.request_ids, outputs.seq_indices))}
        for row, (core_id, index, token_id) in enumerate(
            zip(outputs.request_ids, outputs.seq_indices, outputs.new_token_ids)
        ):
            state = self._by_core_id.get(core_id)
            if state is None or state.finished or state.sequences[index].finished:
                continue  # ended here already (stop string, abort): the core had it in flight
            end = None
            if ended and (last_rows is None or last_rows[(core_id, index)] == row):
                end = ended.pop((core_id, index), None)
            stopped_by_token = end is not None and end.finish_reason == "stop" and end.stop_reason == token_id
            logprobs = outputs.logprobs.get(row) if outputs.logprobs else None
            if self._apply_token(state, index, token_id, logprobs, stopped_by_token, now):
                num_output_tokens = state.sequences[index].num_output_tokens
                aborts.append(AbortRequest(core_id, index, "stop string", num_output_tokens))
            elif end is not None:
                self._end_sequence(state, index, end.finish_reason, end.stop_reason)
            touched.add(state.request_id)
        for end in ended.values():  # ends without a token: aborts, faults
            state = self._by_core_id.get(end.request_id)
            if state is not None and not state.sequences[end.seq_index].finished:
                self._end_sequence(state, end.seq_index, end.finish_reason, None)
                touched.add(state.request_id)
        for core_id, num_dropped in outputs.history_truncated.items():
            state = self._by_core_id.get(core_id)
            if state is not None:
                state.history_truncated_tokens = num_dropped
        for finished in outputs.finished_requests:
            state = self._by_core_id.get(finished.request_id)
            if state is None:
                continue
            if finished.error is not None:
                # A stop string completed it here before the core knew: the error (its deadline, a
                # fault) came too late to matter, but for a session's turn, which the core then did
                # not add to the history: the client must know that.
                if not state.completed or state.in_session:
                    self._fail(state, error_from_core(finished.error))
                touched.add(state.request_id)
            elif not state.finished:  # ended with nothing to generate (a session's close)
                for index in range(len(state.sequences)):
                    self._end_sequence(state, index, "stop", None)
                touched.add(state.request_id)
        if outputs.scheduler_stats is not None:
            self.stats.update_scheduler(
                outputs.scheduler_stats,
                outputs.num_step_faults,
                outputs.gc_pauses,
                outputs.session_stats,
                engine_steps=outputs.step_times,
            )
        if outputs.structured_output_stats is not None:
            self.stats.update_structured_output(outputs.structured_output_stats)
        return touched, aborts

    def _apply_token(
        self,
        state: RequestState,
        index: int,
        token_id: int,
        logprobs: TokenLogprobs | None,
        stopped_by_token: bool,
        now: float,
    ) -> bool:
        """Adds one generated token; True if a stop string ended the sequence with it."""
        seq = state.sequences[index]
        is_first_of_request = state.first_token_time is None
        if is_first_of_request:
            state.first_token_time = now
            # Its prompt was processed (as vLLM counts prefill tokens): a request refused by the core,
            # or ended before its prefill finished, adds none.
            self.stats.on_prompt_processed(state.num_prompt_tokens)
        self.stats.on_token(
            now - state.arrival_time if is_first_of_request else None, seq.last_token_time, now
        )
        seq.last_token_time = now
        seq.num_output_tokens += 1
        seq.pending_token_ids.append(token_id)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs.sampled_logprob
            seq.pending_logprobs.append(position_logprobs(self.tokenizer, token_id, logprobs))
        # A stop token ends generation without becoming text (vLLM), unless asked to include it.
        if stopped_by_token and not state.params.include_stop_str_in_output:
            return False
        update = seq.detokenizer.update([token_id])
        seq.pending_text.append(update.text_delta)
        if update.matched_stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", update.matched_stop
            return True
        return False

    def _end_sequence(self, state: RequestState, index: int, reason: str, stop_reason: int | None) -> None:
        """The core ended the sequence: release held-back text (which may still hold a stop string)."""
        seq = state.sequences[index]
        seq.pending_text.append(seq.detokenizer.finish())
        if seq.detokenizer.matched_stop is not None:  # the flushed tail completed a stop string
            reason, stop_reason = "stop", seq.detokenizer.matched_stop
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _fail(self, state: RequestState, error: BaseException) -> None:
        """Ends the request with an error; running sequences report finish_reason `abort`."""
        for index, seq in enumerate(state.sequences):
            if not seq.finished:
                self._end_sequence(state, index, "abort", None)
        state.error = error

    # ------------------------------------------------------------------------------------ outputs
    def collect(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """One RequestOutput per request with news (everything since its last one); a finished
        request's output is its final one and the request is forgotten."""
        outputs = []
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            deltas = [self._take_delta(state, i) for i, seq in enumerate(state.sequences) if seq.has_news]
            if state.finished:
                del self.requests[request_id]
                del self._by_core_id[state.core_request_id]
                self.stats.on_request_finished(
                    self._outcome(state),
                    time.monotonic() - state.arrival_time,
                    state.num_prompt_tokens,
                    sum(seq.num_output_tokens for seq in state.sequences),
                    len(state.sequences),
                    self._counted_lora_name(state),
                )
                output = RequestOutput(request_id, state.num_prompt_tokens, deltas, True, state.error)
            elif deltas:
                output = RequestOutput(request_id, state.num_prompt_tokens, deltas, False)
            else:
                continue
            output.history_truncated_tokens, state.history_truncated_tokens = (
                state.history_truncated_tokens,
                None,
            )
            outputs.append(output)
        return outputs

    @staticmethod
    def _counted_lora_name(state: RequestState) -> str | None:
        """The adapter a finished request is counted under: only one that generated tokens with it.
        A request the core refused (an unknown name, a busy session), a session's close-only
        request or one failed before its first token may carry any name the client chose, which
        would otherwise become a metric label."""
        if any(seq.num_output_tokens for seq in state.sequences):
            return state.params.lora_name
        return None

    def abort_request(self, request_id: str, error: BaseException) -> RequestOutput | None:
        """Ends a request here (client cancel, shutdown, dead core); returns its final output."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        self._fail(state, error)
        return self.collect([request_id])[0]

    def _take_delta(self, state: RequestState, index: int) -> SequenceDelta:
        seq = state.sequences[index]
        wants_logprobs = state.params.logprobs is not None
        delta = SequenceDelta(
            index=index,
            text="".join(seq.pending_text),
            token_ids=seq.pending_token_ids,
            logprobs=seq.pending_logprobs if wants_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            num_output_tokens=seq.num_output_tokens,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        seq.pending_text, seq.pending_token_ids, seq.pending_logprobs = [], [], []
        seq.reported_final = seq.finished
        return delta

    @staticmethod
    def _outcome(state: RequestState) -> str:
        if isinstance(state.error, RequestAbortedError):
            return "abort"
        if state.error is not None:
            return "error"
        reasons = {seq.finish_reason for seq in state.sequences}
        return "abort" if "abort" in reasons else ("stop" if "stop" in reasons else "length")

    def check_integrity(self) -> None:
        for request_id, state in self.requests.items():
            assert not state.finished, f"request {request_id} finished but not collected"
