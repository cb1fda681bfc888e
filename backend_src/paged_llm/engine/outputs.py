"""What the engine hands to the serving layer after each step (no Triton types here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TopLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str


@dataclass
class PositionLogprobs:
    """Logprobs of one generated position: the sampled token plus the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    decoded_token: str
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class SequenceDelta:
    index: int  # which of the request's n samples
    text: str  # text released since the previous output of this sequence
    token_ids: list[int]  # token ids generated since the previous output
    logprobs: list[PositionLogprobs] | None  # per new token, when the request asked for logprobs
    cumulative_logprob: float | None  # sum over all generated tokens so far (when asked)
    num_output_tokens: int  # generated so far in total
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the sequence's last delta
    stop_reason: int | str | None = None  # the stop token id or stop string, when one matched


@dataclass
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    sequences: list[SequenceDelta]  # only sequences with something new
    finished: bool  # all sequences finished: this is the request's last output
    error: BaseException | None = None  # set when the request failed (validation, fault, shutdown)
    num_steps: int = 1  # engine steps this output covers, at most (more when the stub lagged)
    # On the first output of a session's turn whose history was truncated: the tokens dropped.
    history_truncated_tokens: int | None = None
