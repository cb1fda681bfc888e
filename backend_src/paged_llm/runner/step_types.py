"""What a launched step hands back: `LaunchedStep` (the device work enqueued, its tokens on their way
to the host) and `ModelRunnerOutput` (the step's results on the host, from `LaunchedStep.result()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.runner.input_buffers import PendingTokens
from paged_llm.sampling.sampler import SamplerOutput
from paged_llm.sampling.token_logprobs import TokenLogprobs
from paged_llm.sampling.verify import VerifyOutput
from paged_llm.sequence import Sequence


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # sequence id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # only sequences that asked
    # Sequences that verified proposals: the tokens emitted (accepted proposals, then one token).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; `result()` is the step's one host synchronisation."""

    seqs: list[Sequence]  # the sequences that sample a token, in row order
    sampled: SamplerOutput | None  # device tensors (None: nothing sampled this step)
    host: SamplerOutput | None = None  # the same, copied (or being copied) to host memory
    copied: Any = None  # device event after the copy to the host (None: nothing to wait for)
    verify_seqs: list[Sequence] = field(default_factory=list)  # sequences that verified proposals
    verified: VerifyOutput | None = None  # their verification (device tensors)
    verified_host: VerifyOutput | None = None  # the same on the host
    # Launched ahead with constrained rows: the forward ran, sampling waits for the grammars to take
    # the previous step's tokens (ModelRunner.sample_deferred); these are the rows' logits.
    needs_sampling: bool = False
    unsampled_logits: Any = None
    pending_bitmask: Any = None  # the rows' bitmask being filled (StepBitmask.start), if begun

    def pending_tokens(self) -> PendingTokens:
        """Where this step's tokens will be, for a step launched before its result()."""
        return PendingTokens({s.seq_id: r for r, s in enumerate(self.seqs)})

    def sampled_token_ids(self) -> Any:
        """This step's sampled tokens on the device (None: it sampled none)."""
        assert not self.needs_sampling, "a step launched on one whose sampling is deferred"
        return None if self.sampled is None else self.sampled.sampled_token_ids

    def result(self) -> ModelRunnerOutput:
        if self.needs_sampling:
            raise RuntimeError("result() of a step whose sampling was deferred and never done")
        if self.copied is not None:
            self.copied.synchronize()
        output = ModelRunnerOutput()
        verified = self.verified_host or self.verified
        if verified is not None:
            token_ids = verified.token_ids.tolist()
            for seq, row, count in zip(self.verify_seqs, token_ids, verified.num_emitted.tolist()):
                output.spec_token_ids[seq.seq_id] = row[:count]
        if self.sampled is None:
            return output
        sampled, seqs = self.host or self.sampled, self.seqs
        token_ids = sampled.sampled_token_ids.tolist()
        output.sampled_token_ids = {r.seq_id: t for r, t in zip(seqs, token_ids)}
        if sampled.sampled_logprobs is None:
            return output
        logprobs = sampled.sampled_logprobs.tolist()
        ranks = sampled.sampled_ranks.tolist() if sampled.sampled_ranks is not None else [0] * len(seqs)
        top_ids = sampled.topk_token_ids.tolist() if sampled.topk_token_ids is not None else None
        top_values = sampled.topk_logprobs.tolist() if sampled.topk_logprobs is not None else None
        for row, seq in enumerate(seqs):
            num_top = seq.sampling_params.logprobs
            if num_top is None:
                continue
            output.logprobs[seq.seq_id] = TokenLogprobs(
                sampled_logprob=float(logprobs[row]),
                sampled_rank=int(ranks[row]),
                top_token_ids=top_ids[row][:num_top] if top_ids else [],
                top_logprobs=top_values[row][:num_top] if top_values else [],
            )
        return output
