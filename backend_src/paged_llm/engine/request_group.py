"""The engine's record of one client request: its n sequences, their detokenizers, and the output
each has produced since the serving layer last took a delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.engine.outputs import PositionLogprobs, SequenceDelta, TopLogprob
from paged_llm.request import Request
from paged_llm.runner.model_runner import TokenLogprobs
from paged_llm.sampling_params import SamplingParams
from paged_llm.tokenizer.detokenizer import IncrementalDetokenizer, decode_token

_UINT64_MASK = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request (splitmix64 of seed + index; sample 0 keeps the seed)."""
    if index == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * index) & _UINT64_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return z ^ (z >> 31)


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
class SequenceState:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float = 0.0
    finished: bool = False  # generation ended (its request is finished)
    reported_final: bool = False  # the delta carrying finish_reason was handed out
    # Output produced since the serving layer last received this sequence's delta.
    pending_text: list[str] = field(default_factory=list)
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def has_news(self) -> bool:
        return bool(
            self.pending_token_ids or self.pending_text or (self.finished and not self.reported_final)
        )


@dataclass
class RequestGroup:
    """One client request: its n sequences and the siblings not yet admitted."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    unstarted: list[Request]  # samples 1..n-1, added once sample 0 computed the prompt
    arrival_time: float
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return not self.unstarted and all(s.finished for s in self.sequences)

    def sequence_of(self, request: Request) -> SequenceState:
        return next(s for s in self.sequences if s.request is request)

    def take_delta(self, index: int) -> SequenceDelta:
        """Hands out (and clears) what sequence `index` produced since its last delta."""
        seq = self.sequences[index]
        request = seq.request
        wants_logprobs = self.params.logprobs is not None
        delta = SequenceDelta(
            index=index,
            text="".join(seq.pending_text),
            token_ids=seq.pending_token_ids,
            logprobs=seq.pending_logprobs if wants_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            num_output_tokens=request.num_output_tokens,
            finish_reason=request.status.finish_reason if seq.finished else None,
            stop_reason=request.stop_reason if seq.finished else None,
        )
        seq.pending_text, seq.pending_token_ids, seq.pending_logprobs = [], [], []
        seq.reported_final = seq.finished
        return delta

    def finish_unfinished(self) -> list[SequenceDelta]:
        """Ends every sequence still running (abort, fault): releases held-back text, final deltas."""
        deltas = []
        for index, seq in enumerate(self.sequences):
            if seq.finished:
                continue
            seq.pending_text.append(seq.detokenizer.finish())
            seq.finished = True
            deltas.append(self.take_delta(index))
        return deltas
