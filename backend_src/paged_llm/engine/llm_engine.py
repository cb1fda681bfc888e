"""The synchronous engine: `add_request`, `abort_request`, `step() -> list[RequestOutput]`.

One client request with `n` samples becomes `n` scheduler requests ("sequences"). The first one
runs the prompt; the others are added once its prompt KV is computed, so they take the prompt's
full blocks from the prefix cache instead of recomputing them.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from paged_llm.config import EngineConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.scheduler import Scheduler
from paged_llm.engine.outputs import RequestOutput, SequenceDelta
from paged_llm.engine.request_group import RequestGroup, SequenceState, derive_seed, position_logprobs
from paged_llm.engine.stats import EngineStats
from paged_llm.errors import InvalidRequestError, RequestAbortedError
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.models.hf_config import ModelSpec, load_model_spec
from paged_llm.request import Request, RequestStatus
from paged_llm.runner.device import Device
from paged_llm.runner.kv_sizing import plan_kv_cache
from paged_llm.runner.model_runner import ModelRunner, ModelRunnerOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.tokenizer.detokenizer import IncrementalDetokenizer
from paged_llm.tokenizer.hf_tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model.model)
        self.spec: ModelSpec = load_model_spec(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.device = Device.resolve(config.device.device)
        self.dtype = self.device.model_dtype(config.model.dtype, self.spec.checkpoint_dtype)
        requested_len = config.model.max_model_len or self.spec.max_position_embeddings
        block_size = config.cache.block_size_tokens
        self.runner = ModelRunner(
            self.spec,
            self.model_dir,
            self.device,
            self.dtype,
            requested_len,
            block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            enable_cuda_graphs=config.device.enable_cuda_graphs,
        )
        self.runner.load(show_progress=show_progress)
        plan = plan_kv_cache(config, self.runner, self.device)
        self.runner.allocate_kv_cache(plan.num_blocks)
        self.max_model_len = min(requested_len, plan.num_blocks * block_size)
        if self.max_model_len < requested_len:
            logger.warning(
                "KV pool holds %d tokens, less than max_model_len %d: max_model_len lowered to %d",
                plan.num_blocks * block_size,
                requested_len,
                self.max_model_len,
            )
        logger.info(
            "paged_llm: %s (%s) on %s, dtype %s; KV pool %d blocks x %d tokens = %d tokens (%.1f MiB); "
            "max_model_len %d",
            self.model_dir,
            self.spec.architecture,
            self.device.describe(),
            str(self.dtype).removeprefix("torch."),
            plan.num_blocks,
            block_size,
            plan.num_blocks * block_size,
            plan.num_blocks * self.runner.kv_bytes_per_block / (1 << 20),
            self.max_model_len,
        )
        salt = hashlib.sha256(
            (self.model_dir / "config.json").read_bytes() + str(self.dtype).encode()
        ).digest()
        self.kv_cache = KVCacheManager(plan.num_blocks, block_size, config.cache.enable_prefix_caching, salt)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.groups: dict[str, RequestGroup] = {}
        self._seq_to_group: dict[str, RequestGroup] = {}
        self._seed_rng = random.Random(config.model.seed)
        self._num_steps = 0
        # (scheduler updates, runner output) of the last step, turned into outputs during the next one.
        self._pending: tuple[list[tuple[Request, int | None]], ModelRunnerOutput] | None = None
        self.stats = EngineStats()

    # ---------------------------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Raises InvalidRequestError for prompts that can never be served (checked before queueing)."""
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise InvalidRequestError("text_input", "the prompt is empty")
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "text_input",
                f"the prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}, "
                f"which leaves no room for output (at most {self.max_model_len - 1} prompt tokens)",
            )
        vocab = self.spec.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        num_blocks = self.kv_cache.num_blocks_for_tokens(num_tokens + 1)
        if num_blocks > self.kv_cache.num_blocks:
            raise InvalidRequestError(
                "text_input",
                f"the prompt needs {num_blocks} KV blocks but the whole pool has {self.kv_cache.num_blocks}",
            )

    def validate_params(self, params: SamplingParams) -> None:
        """Checks of sampling parameters that depend on the model (vocabulary, context length)."""
        params.validate_for_vocab(self.spec.vocab_size)
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"{params.max_tokens} exceeds max_model_len {self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        deadline: float | None = None,
    ) -> None:
        if request_id in self.groups:
            raise InvalidRequestError("request id", f"{request_id!r} is already in flight")
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        now = time.monotonic()
        prompt = list(prompt_token_ids)
        requests = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=prompt,
                sampling_params=params,
                seed=derive_seed(seed, index),
                eos_token_ids=self.spec.eos_token_ids,
                arrival_time=now,
                deadline=deadline,
            )
            for index in range(params.n)
        ]
        group = RequestGroup(
            request_id=request_id,
            params=params,
            prompt_token_ids=prompt,
            sequences=[],
            unstarted=requests[1:],
            arrival_time=now,
        )
        self.groups[request_id] = group
        self._start_sequence(group, requests[0])
        self.stats.on_request_added(len(prompt))

    def _start_sequence(self, group: RequestGroup, request: Request) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=group.params.skip_special_tokens,
            stop=group.params.stop,
            include_stop_str_in_output=group.params.include_stop_str_in_output,
        )
        group.sequences.append(SequenceState(request, detokenizer))
        self._seq_to_group[request.request_id] = group
        self.scheduler.add_request(request)

    def _start_siblings(self, group: RequestGroup) -> None:
        first = group.sequences[0].request
        for request in group.unstarted:
            request.arrival_seq = first.arrival_seq  # same place in the queue as the first sample
            self._start_sequence(group, request)
        group.unstarted = []

    def abort_request(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        """Ends a request now; returns its final output, whose error says why (None if unknown)."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        live = [s.request for s in group.sequences if not s.finished]
        states = sorted({r.status.value for r in live}) or ["finished"]
        logger.info(
            "request %s aborted (%s) while %s, after %d generated tokens",
            request_id,
            reason,
            "/".join(states),
            sum(s.request.num_output_tokens for s in group.sequences),
        )
        self.scheduler.finish_requests([r.request_id for r in live], RequestStatus.FINISHED_ABORTED)
        group.unstarted = []
        deltas = group.finish_unfinished()
        output = self._close_group(group, deltas, error=RequestAbortedError(reason))
        self.stats.update_scheduler(self.scheduler.stats())
        return output

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

    # -------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One engine step. The outputs of step N are built while the device runs step N + 1:

            launch(N+1) -> [build outputs of N: detokenize, stop strings, logprobs] -> result(N+1)

        so the CPU-heavy output work overlaps the model. A request that a stop string ends while
        its next token is in flight simply has that token dropped (update_from_output skips
        finished requests), and its blocks are reused only by a later schedule(), after the sync.
        """
        outputs = self._expire_deadlines()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return outputs + self._process_pending()
        self._num_steps += 1
        try:
            if self.config.fault_injection_step == self._num_steps:
                raise RuntimeError(f"injected fault at step {self._num_steps} (fault_injection_step)")
            launched = self.runner.launch(scheduler_output)
            outputs += self._process_pending()
            runner_output = launched.result()
        except Exception as error:  # a model fault must not take the server down
            return outputs + self._process_pending() + self._fail_step(scheduler_output.scheduled, error)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        self._pending = (updates, runner_output)
        self.stats.update_scheduler(self.scheduler.stats())
        return outputs

    def _process_pending(self) -> list[RequestOutput]:
        """Turns the sampled tokens of the last finished step into RequestOutputs."""
        if self._pending is None:
            return []
        updates, runner_output = self._pending
        self._pending = None
        touched: dict[str, RequestGroup] = {}
        for request, token_id in updates:
            group = self._seq_to_group.get(request.request_id)
            if token_id is None or group is None:  # a prefill chunk, or aborted since the step
                continue
            self._apply_token(group, request, token_id, runner_output)
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            output = self._collect(group)
            if output is not None:
                outputs.append(output)
        self.stats.update_scheduler(self.scheduler.stats())
        return outputs

    def _apply_token(
        self, group: RequestGroup, request: Request, token_id: int, runner_output: ModelRunnerOutput
    ) -> None:
        seq = group.sequence_of(request)
        now = time.monotonic()
        self.stats.on_token(request, now, is_first_of_request=group.first_token_time is None)
        if group.first_token_time is None:
            group.first_token_time = now
        seq.pending_token_ids.append(token_id)
        token_logprobs = runner_output.logprobs.get(request.request_id)
        if token_logprobs is not None:
            seq.cumulative_logprob += token_logprobs.sampled_logprob
            seq.pending_logprobs.append(position_logprobs(self.tokenizer, token_id, token_logprobs))
        # A stop token ends generation without becoming text (vLLM), unless asked to include it.
        stopped_by_token = (
            request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == token_id
        )
        if not stopped_by_token or group.params.include_stop_str_in_output:
            update = seq.detokenizer.update([token_id])
            seq.pending_text.append(update.text_delta)
            if update.matched_stop is not None:
                if not request.is_finished:
                    self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED  # a stop string beats "length"
                request.stop_reason = update.matched_stop
        if request.is_finished:
            if not isinstance(request.stop_reason, str):
                seq.pending_text.append(seq.detokenizer.finish())
                if seq.detokenizer.matched_stop is not None:  # the flushed tail held a stop string
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = seq.detokenizer.matched_stop
            seq.finished = True
        if group.unstarted and seq is group.sequences[0]:
            self._start_siblings(group)

    def _collect(self, group: RequestGroup) -> RequestOutput | None:
        deltas = [group.take_delta(index) for index, seq in enumerate(group.sequences) if seq.has_news]
        if group.finished:
            return self._close_group(group, deltas)
        if not deltas:
            return None
        return RequestOutput(group.request_id, len(group.prompt_token_ids), deltas, False)

    def _close_group(
        self, group: RequestGroup, deltas: list[SequenceDelta], error: BaseException | None = None
    ) -> RequestOutput:
        del self.groups[group.request_id]
        for seq in group.sequences:
            self._seq_to_group.pop(seq.request.request_id, None)
        self.stats.on_request_finished(group, time.monotonic(), error)
        return RequestOutput(group.request_id, len(group.prompt_token_ids), deltas, True, error)

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        expired = [
            group.request_id
            for group in self.groups.values()
            if group.sequences
            and group.sequences[0].request.deadline is not None
            and group.sequences[0].request.deadline <= now
        ]
        outputs = []
        for request_id in expired:
            waited = now - self.groups[request_id].arrival_time
            output = self.abort_request(request_id, f"timed out after {waited:.3f} s (request timeout)")
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_step(self, scheduled, error: Exception) -> list[RequestOutput]:
        """A model fault: fail every request of the step (INTERNAL), drop cached KV, keep serving."""
        logger.error(
            "model step %d failed; failing %d requests:\n%s",
            self._num_steps,
            len(scheduled),
            "".join(traceback.format_exception(error)),
        )
        self.stats.num_step_faults += 1
        group_ids = []
        for item in scheduled:
            group = self._seq_to_group.get(item.request_id)
            if group is not None and group.request_id not in group_ids:
                group_ids.append(group.request_id)
        outputs = []
        for group_id in group_ids:
            group = self.groups[group_id]
            live = [s.request.request_id for s in group.sequences if not s.finished]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ERROR)
            group.unstarted = []
            deltas = group.finish_unfinished()
            outputs.append(self._close_group(group, deltas, error=error))
        # KV written by the failed step may be garbage: never serve it from the prefix cache.
        self.kv_cache.reset_prefix_cache()
        return outputs

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = {s.request.request_id for g in self.groups.values() for s in g.sequences if not s.finished}
        # Sequences the last step finished are still live here until its outputs are processed.
        finishing = {r.request_id for r, _ in self._pending[0] if r.is_finished} if self._pending else set()
        assert live - finishing == set(self.scheduler.requests), (
            "engine and scheduler disagree on live sequences"
        )
