"""A draft model as proposer: a smaller checkpoint with the target's vocabulary runs k greedy steps
per proposing sequence before the target's step, and its k tokens are the proposals.

The draft has its own KV cache (its own layer shapes) indexed by the target's block tables: a
sequence's draft KV for position p lives in the same block and slot as its target KV. Before
proposing, the target's slots for the positions the draft and then the verification write (up to
the last token + k) are reserved through the KV cache manager; a sequence whose slots the pool
cannot give proposes nothing this step.

    tokens       t0 ... t(N-1)                    the sequence (N known tokens)
    draft step A computes positions dnc .. N-1     (catch-up: what the draft has not seen yet, with
                                                    its prompt the first time) -> d1 at N-1's logits
    draft step j (1 .. k-1): input d_j at N-1+j    -> d(j+1)    (one token per sequence: the draft's
                                                    CUDA graphs; each step takes the previous one's
                                                    token on the device)

Which draft KV is still valid at the next proposal: the positions whose input equals the sequence's
token there now (the accepted proposals); a preempted sequence starts over (its blocks were freed).
Greedy proposals are deterministic given the sequence, so the target verifies them as one-hot
proposals (sampling/rejection.py): sampled requests keep the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from paged_llm.config import ConfigError, EngineConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.scheduler import ScheduledSequence, SchedulerOutput
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.models.hf_config import ModelSpec, load_model_spec
from paged_llm.runner.device import Device
from paged_llm.runner.model_runner import ModelRunner
from paged_llm.runner.step_types import LaunchedStep
from paged_llm.sequence import PENDING_TOKEN, Sequence


def load_draft_runner(
    config: EngineConfig,
    target: ModelSpec,
    device: Device,
    dtype: object,
    max_model_len: int,
    show_progress: bool = True,
) -> ModelRunner:
    """The draft checkpoint loaded on the target's device and dtype, as a runner that always takes
    the argmax; its KV cache is allocated later with the target's number of blocks."""
    draft_dir = resolve_model_dir(config.speculative.speculative_model)
    spec = load_model_spec(draft_dir)
    if spec.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_model {draft_dir} has a vocabulary of {spec.vocab_size} tokens, the model "
            f"{target.vocab_size}: a draft model must share the target's tokenizer"
        )
    runner = ModelRunner(
        spec,
        draft_dir,
        device,
        dtype,  # type: ignore[arg-type]
        max_model_len,
        config.cache.block_size_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        enable_cuda_graphs=config.device.enable_cuda_graphs,
        enable_triton_gemv=config.device.enable_triton_gemv,
        enable_onednn_linear=config.device.enable_onednn_linear,
        greedy_only=True,
    )
    runner.load(show_progress=show_progress)
    return runner


class _TokensThenDrafts:
    """A sequence's token ids followed by `extra` entries (the draft's inputs past the known
    tokens: PENDING_TOKEN, each taken on the device from the draft step before); read-only."""

    def __init__(self, base: list[int], num_extra: int) -> None:
        self.base = base
        self.num_extra = num_extra

    def __len__(self) -> int:
        return len(self.base) + self.num_extra

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            assert step == 1 and stop <= len(self.base), "slices cover known tokens only"
            return self.base[start:stop]
        if index < 0:
            index += len(self)
        return self.base[index] if index < len(self.base) else PENDING_TOKEN


@dataclass(eq=False)
class _DraftView:
    """What the draft runner reads of a sequence for one draft step."""

    seq_id: str
    all_token_ids: _TokensThenDrafts
    num_known_tokens: int


@dataclass
class _DraftState:
    """A sequence's draft KV: positions < num_base hold its tokens' KV; the next ones hold the KV of
    `written` (the draft's own proposals, fed back as inputs)."""

    num_base: int = 0
    written: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    def num_valid(self, seq: Sequence) -> int:
        """Positions whose draft KV was computed from the token the sequence has there now."""
        if seq.num_preemptions != self.num_preemptions:
            return 0
        tokens = seq.all_token_ids
        valid = self.num_base
        for token in self.written:
            if valid >= len(tokens) or tokens[valid] != token:
                break
            valid += 1
        return valid


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.max_step_tokens = runner.max_num_batched_tokens
        self.num_draft_steps = 0  # draft forward passes, since start

    def propose(self, seqs: Iterable[Sequence], num_speculative_tokens: int) -> None:
        seqs = list(seqs)
        items: list[ScheduledSequence] = []
        wanted: dict[str, int] = {}  # proposals each sampling sequence gets
        budget = self.max_step_tokens
        for seq in seqs:
            seq.spec_token_ids = []
            num_tokens = seq.num_tokens
            k = min(num_speculative_tokens, self.max_model_len - num_tokens - 1)
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                k = min(k, max_tokens - seq.num_output_tokens - 1)
            if k <= 0 or budget <= 0:
                continue
            state = seq.proposer_state
            if not isinstance(state, _DraftState):
                state = seq.proposer_state = _DraftState()
            start = min(state.num_valid(seq), num_tokens - 1)
            # Slots up to the last token + k: the draft writes up to + k - 1, the verification + k.
            # Not from the last free blocks: sequences that decode need those more than proposals.
            held = len(self.kv_cache.block_ids_view(seq.seq_id))
            new_blocks = self.kv_cache.num_blocks_for_tokens(num_tokens + k) - held
            if new_blocks > 0 and self.kv_cache.num_free_blocks - new_blocks < len(seqs):
                continue
            if self.kv_cache.allocate_slots(seq, k + 1) is None:
                continue
            num_new = min(num_tokens - start, budget)
            budget -= num_new
            samples = start + num_new == num_tokens
            items.append(self._item(seq, start, num_new, 0, samples))
            state.num_base, state.written = start + num_new, []
            state.num_preemptions = seq.num_preemptions
            if samples:
                wanted[seq.seq_id] = k
        if not items:
            return
        by_id = {seq.seq_id: seq for seq in seqs}
        steps = [self._launch(items, None)]
        for step in range(1, max(wanted.values(), default=0)):
            decode = [self._item(by_id[seq_id], 0, 1, step, True) for seq_id, k in wanted.items() if k > step]
            steps.append(self._launch(decode, steps[-1]))
        proposals: dict[str, list[int]] = {seq_id: [] for seq_id in wanted}
        for launched in steps:
            for seq_id, token in launched.result().sampled_token_ids.items():
                if seq_id in proposals:
                    proposals[seq_id].append(token)
        for seq in seqs:
            drafts = proposals.get(seq.seq_id)
            if drafts:
                seq.spec_token_ids = drafts
                state = seq.proposer_state
                assert isinstance(state, _DraftState)
                state.written = drafts[:-1]  # inputs of the draft steps after the catch-up

    def _item(self, seq: Sequence, start: int, num_new: int, step: int, samples: bool) -> ScheduledSequence:
        """Step 0 (catch-up): `num_new` known tokens from `start`. Step j >= 1: the draft's own
        token j at position num_tokens - 1 + j."""
        num_tokens = seq.num_tokens
        if step:
            start = num_tokens - 1 + step
        view = _DraftView(seq.seq_id, _TokensThenDrafts(seq.all_token_ids, step), num_tokens)
        return ScheduledSequence(
            seq=view,  # type: ignore[arg-type]
            num_computed_tokens=start,
            num_new_tokens=num_new,
            block_ids=self.kv_cache.block_ids_view(seq.seq_id),
            needs_sample=samples,
        )

    def _launch(self, items: list[ScheduledSequence], previous: LaunchedStep | None) -> LaunchedStep:
        output = SchedulerOutput(scheduled=items, num_batched_tokens=sum(i.num_new_tokens for i in items))
        self.num_draft_steps += 1
        return self.runner.launch(output, previous)
