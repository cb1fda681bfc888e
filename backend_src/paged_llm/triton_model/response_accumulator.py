"""RequestOutputs -> response tensors (vllm_backend's outputs), as few or as many responses as asked.

Outputs queue up per request; each `take()` turns the ones waiting into the next response:

    add(o1) add(o2) add(o3)          take() -> o1+o2 (max_merged_steps = 2), take() -> o3

Streaming: a response holds at most `max_merged_steps` engine steps, at least one output (so a
sender that keeps up sends one response per step, and one that lags catches up in larger ones).
Non-streaming: nothing until the request finished, then one response with all of its text.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from paged_llm.engine.outputs import PositionLogprobs, RequestOutput
from paged_llm.triton_model.triton_codec import ParsedRequest, logprobs_json


@dataclass
class _SequenceState:
    text: list[str] = field(default_factory=list)  # pending (streaming) or all (non-streaming) text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_new_tokens: int = 0  # tokens since the last response
    num_tokens: int = 0  # tokens generated in all
    finish_reason: str | None = None


@dataclass
class Response:
    """What the next response carries: tensors, or the request's error (then it is the final one)."""

    tensors: dict[str, np.ndarray] | None
    is_final: bool
    error: BaseException | None = None
    num_tokens: int = 0  # generated tokens in it (all sequences)


class ResponseAccumulator:
    def __init__(
        self, parsed: ParsedRequest, prompt_text: str, num_prompt_tokens: int, max_merged_steps: int = 16
    ) -> None:
        self.parsed = parsed
        self.prompt_text = prompt_text
        self.num_prompt_tokens = num_prompt_tokens
        self.max_merged_steps = max_merged_steps
        self.sequences = [_SequenceState() for _ in range(parsed.params.n)]
        self.finished = False  # the final output was taken
        self.history_truncated_tokens: int | None = None  # to send on the next response
        self._pending: collections.deque[RequestOutput] = collections.deque()

    def add(self, output: RequestOutput) -> None:
        self._pending.append(output)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take(self, discard_data: bool = False) -> Response | None:
        """The next response, or None when there is nothing to send yet. `discard_data`: the client
        cancelled; drop everything but the final output."""
        steps = 0
        news = False
        while self._pending and not self.finished:
            head = self._pending[0]
            is_error = head.finished and head.error is not None
            if (
                self.parsed.stream
                and not discard_data
                and news
                and (is_error or steps + head.num_steps > self.max_merged_steps)
            ):
                break  # over the merge limit, or an error: the data taken so far goes out first
            output = self._pending.popleft()
            steps += output.num_steps
            if is_error:
                self.finished = True
                return Response(None, True, output.error)
            self._apply(output)
            news = news or bool(output.sequences)
            self.finished = output.finished
        if discard_data and not self.finished:
            return None
        if not self.finished and (not self.parsed.stream or not news):
            return None
        tensors = self._encode()
        num_tokens = sum(state.num_new_tokens for state in self.sequences)
        for state in self.sequences:
            if self.parsed.stream:
                state.text, state.token_ids, state.logprobs = [], [], []
            state.num_new_tokens = 0
        return Response(tensors, self.finished, None, num_tokens)

    def _apply(self, output: RequestOutput) -> None:
        for delta in output.sequences:
            state = self.sequences[delta.index]
            state.text.append(delta.text)
            state.token_ids.extend(delta.token_ids)
            state.num_new_tokens += len(delta.token_ids)
            state.num_tokens += len(delta.token_ids)
            if delta.logprobs:
                state.logprobs.extend(delta.logprobs)
            if delta.cumulative_logprob is not None:
                state.cumulative_logprob = delta.cumulative_logprob
            if delta.finish_reason is not None:
                state.finish_reason = delta.finish_reason
        self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
        if output.history_truncated_tokens:
            self.history_truncated_tokens = output.history_truncated_tokens

    def _encode(self) -> dict[str, np.ndarray]:
        """The response's tensors: text_output and output_ids always, the others when their
        return_* flag is set; of those, only the ones the client asked for are built."""
        flags = self.parsed.return_flags
        wanted = self.parsed.requested_outputs

        def wants(name: str, flag: str | None = None) -> bool:
            return (wanted is None or name in wanted) and (flag is None or flag in flags)

        tensors: dict[str, np.ndarray] = {}
        # paged_llm_totals_on_final: a streamed response before the last carries text alone.
        totals_now = self.finished or not self.parsed.totals_on_final
        if wants("text_output"):
            echo = not self.parsed.stream and not self.parsed.exclude_input_in_output
            texts = [(self.prompt_text if echo else "") + "".join(s.text) for s in self.sequences]
            tensors["text_output"] = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
        if wants("output_ids"):
            tensors["output_ids"] = np.array([t for s in self.sequences for t in s.token_ids], dtype=np.int32)
        if (
            wants("finish_reason", "return_finish_reason")
            and (self.finished or self.parsed.stream)
            and totals_now
        ):
            # vllm_backend: streamed responses before the last carry the string "None"
            unfinished = "abort" if self.finished else "None"
            reasons = [(s.finish_reason or unfinished).encode() for s in self.sequences]
            tensors["finish_reason"] = np.array(reasons, dtype=np.object_)
        if wants("cumulative_logprob", "return_cumulative_logprob"):
            tensors["cumulative_logprob"] = np.array(
                [s.cumulative_logprob for s in self.sequences], dtype=np.float32
            )
        if wants("logprobs", "return_logprobs"):
            encoded = [
                logprobs_json(s.logprobs).encode("utf-8") if self.parsed.logprobs_requested else b"null"
                for s in self.sequences
            ]
            tensors["logprobs"] = np.array(encoded, dtype=np.object_)
        if wants("num_input_tokens", "return_num_input_tokens") and totals_now:
            tensors["num_input_tokens"] = np.array([self.num_prompt_tokens], dtype=np.uint32)
        if wants("num_output_tokens", "return_num_output_tokens") and totals_now:
            per_response = self.parsed.stream and not self.parsed.totals_on_final
            counts = [s.num_new_tokens if per_response else s.num_tokens for s in self.sequences]
            tensors["num_output_tokens"] = np.array(counts, dtype=np.uint32)
        if self.history_truncated_tokens is not None and wants("history_truncated"):
            tensors["history_truncated"] = np.array([self.history_truncated_tokens], dtype=np.uint32)
        self.history_truncated_tokens = None
        return tensors
