"""EngineCore: scheduler, KV cache manager, model runner and sampler behind `add_request`,
`abort_request` and `step() -> EngineCoreOutputs`. It knows token ids only: tokenizing, detokenizing,
stop strings and logprob text are the stub's (engine/output_processor.py).

One client request with `n` samples becomes `n` sequences. The first one runs the prompt; the others
are added once its prompt KV is computed, so they take the prompt's full blocks from the prefix
cache instead of recomputing them.

The requests and their sequences are the request table's (engine/engine_core/request_table.py), which every
path that ends a request goes through: request expiry (deadlines, queue waits, engine/engine_core/expiry.py),
a failed model step (engine/engine_core/faults.py) and the core itself.

The same class runs in the engine core process (engine/engine_core/process.py), in a thread of the caller
(engine/core_client.py) or stepped directly by the offline LLMEngine.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from paged_llm.config import EngineConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.core.scheduler import (
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
    SequenceUpdate,
    sampled_grammar_tokens,
)
from paged_llm.core.sessions import SessionManager
from paged_llm.engine.core_types import (
    AbortRequest,
    CoreError,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishedRequest,
    FinishedSequence,
)
from paged_llm.engine.engine_core.expiry import expire_deadlines, expire_queue_waits
from paged_llm.engine.engine_core.faults import StepFaults
from paged_llm.engine.engine_core.lora_updates import LoRAUpdates
from paged_llm.engine.engine_core.model_setup import load_engine_model
from paged_llm.engine.engine_core.request_table import CoreRequest, RequestTable
from paged_llm.engine.engine_core.structured_outputs import StructuredOutputs
from paged_llm.engine.step_times import StepClock
from paged_llm.engine.validation import validate_params, validate_prompt
from paged_llm.errors import InvalidRequestError, QueueFullError, SessionNotFoundError, TensorParallelError
from paged_llm.gc_pauses import process_gc_pauses
from paged_llm.runner.step_types import LaunchedStep, ModelRunnerOutput
from paged_llm.sequence import GrammarRejectedToken, GrammarTokens, Sequence, SequenceStatus
from paged_llm.spec_decode.draft_model import DraftModelProposer
from paged_llm.spec_decode.proposer import make_proposer
from paged_llm.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)

_UINT64_MASK = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request (splitmix64 of seed + index; sample 0 keeps the seed)."""
    if index == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * index) & _UINT64_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return z ^ (z >> 31)


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    launched: LaunchedStep  # its result() is the step's one host synchronisation
    step_number: int  # EngineCore.num_steps when it was launched


class EngineCore:
    UTILITY_CALLS = frozenset(
        {
            "check_integrity",
            "scheduler_stats",
            "reset_prefix_cache",
            "load_lora_adapter",
            "unload_lora_adapter",
            "lora_adapter_names",
        }
    )

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        loaded = load_engine_model(config, show_progress)
        self.device, self.runner, self.info = loaded.device, loaded.runner, loaded.info
        draft_runner = loaded.draft_runner
        max_model_len, block_size = self.info.max_model_len, self.info.block_size_tokens
        salt = loaded.prefix_cache_salt
        num_blocks = self.info.num_kv_blocks
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, salt)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, max_model_len)
        self.sessions = SessionManager(config.sessions, self.kv_cache, max_model_len)
        self.scheduler.reclaim_kv = self.sessions.reclaim_idle_kv
        if config.lora.enabled:
            self.scheduler.max_loras = config.lora.max_loras
        self.lora_updates = LoRAUpdates(
            self.runner.lora,
            config.lora.allow_runtime_lora_updates,
            self.info,
            self._live_sequences,
            self._forget_lora_kv,
        )
        self._outputs = EngineCoreOutputs()  # what the current step() publishes, built as it goes
        self.requests = RequestTable(self.scheduler, self.sessions, lambda: self._outputs)
        # Looked up at each fault: a test may swap the runner.
        self.faults = StepFaults(
            self.requests, self.kv_cache, self.sessions, lambda: self.runner.check_workers()
        )
        self._seed_rng = random.Random(config.model.seed)
        self.num_steps = 0
        self.step_clock = StepClock()
        mode = config.scheduler.async_scheduling
        # Launch a step before the previous one's tokens are on the host (step_pipelined).
        self.launch_ahead = mode == "on" or (mode == "auto" and self.device.is_accelerator)
        # Speculative decoding: proposals need the previous step's tokens on the host, so a step
        # that proposes is not launched ahead; while proposing pauses (it did not pay) it is.
        proposer = make_proposer(config.speculative)
        if draft_runner is not None:
            proposer = DraftModelProposer(draft_runner, self.kv_cache, max_model_len)
        spec_config = config.speculative
        self.speculator = (
            Speculator(proposer, spec_config.num_speculative_tokens, spec_config.speculative_pause_below)
            if proposer is not None
            else None
        )
        # Drive the core with step_pipelined(): on an accelerator publishing overlaps the device work.
        self.pipelined = self.launch_ahead or self.device.is_accelerator
        self._in_flight: InFlightStep | None = None  # step_pipelined's launched, unfinished step
        self.num_steps_launched_ahead = 0  # steps launched before the previous step's tokens arrived
        # Called from another thread when there is work that did not come through the inbox (a
        # grammar compiled): the busy loop sets it to wake itself up.
        self.wake: Callable[[], None] = lambda: None
        self.structured = StructuredOutputs(config.structured_output, self.info, lambda: self.wake())
        process_gc_pauses()  # counting starts now

    # ---------------------------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request. InvalidRequestError / QueueFullError: it was not queued."""
        if request.request_id in self.requests:
            raise InvalidRequestError("request id", f"{request.request_id!r} is already in flight")
        if request.session is not None and request.session.closes_only(request.prompt_token_ids):
            self._close_session(request)
            return
        validate_prompt(self.info, request.prompt_token_ids)
        validate_params(self.info, request.params)
        params = request.params
        if request.session is not None and params.n != 1:
            raise InvalidRequestError("n", f"a session's turn has one sample, got n={params.n}")
        scheduler_config = self.config.scheduler
        max_queued = scheduler_config.max_queued_requests
        if self.scheduler.num_waiting >= max_queued:
            raise QueueFullError(f"the waiting queue is full ({max_queued} requests); retry later")
        if scheduler_config.admission_policy == "reject":
            if params.n > scheduler_config.max_num_seqs:  # could never be admitted: not a load problem
                raise InvalidRequestError(
                    "n",
                    f"{params.n} samples can never run at once "
                    f"(max_num_seqs={scheduler_config.max_num_seqs})",
                )
            num_live = sum(r.num_samples - len(r.reported_finished) for r in self.requests)
            if num_live + params.n > scheduler_config.max_num_seqs:
                raise QueueFullError(
                    f"the engine is at capacity ({num_live} of max_num_seqs={scheduler_config.max_num_seqs}"
                    " sequences live, admission_policy reject); retry later"
                )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        prompt = list(request.prompt_token_ids)
        lora = self.runner.lora
        lora_load_id = lora.load_id(params.lora_name) if lora is not None and params.lora_name else 0
        if request.session is not None:  # the last check: it marks the session busy
            self.sessions.expire_idle()
            turn = self.sessions.begin_turn(
                request.session, request.request_id, prompt, params.max_tokens, params.lora_name, lora_load_id
            )
            prompt = turn.prompt_token_ids
            if turn.num_dropped_tokens:
                self._outputs.history_truncated[request.request_id] = turn.num_dropped_tokens
        cap = self.config.limits.max_tokens
        if params.max_tokens is None and cap is not None:  # "until max_model_len", within the server cap
            params = replace(params, max_tokens=max(1, min(cap, self.info.max_model_len - len(prompt))))
        sequences = [
            Sequence(
                seq_id=request.request_id if params.n == 1 else f"{request.request_id}#{index}",
                prompt_token_ids=prompt,
                sampling_params=params,
                seed=derive_seed(seed, index),
                eos_token_ids=self.info.eos_token_ids,
                arrival_time=request.arrival_time,
                deadline=request.deadline,
                lora_load_id=lora_load_id,
            )
            for index in range(params.n)
        ]
        record = CoreRequest(
            request_id=request.request_id,
            sequences=[],
            unstarted=sequences[1:],
            deadline=request.deadline,
            arrival_time=request.arrival_time,
            session=request.session,
        )
        if request.session is not None:
            self.sessions.attach(request.session.session_id, sequences[0])
        constraint = params.structured_outputs
        if constraint is not None and not self.structured.attach_or_park(record, sequences, constraint):
            self.requests.add(record, sequences[0], parked=True)  # starts once the grammar is compiled
            return
        self.requests.add(record, sequences[0])

    def _close_session(self, request: EngineCoreRequest) -> None:
        """A request with no new tokens that ends a session: closes it, generates nothing."""
        assert request.session is not None
        session = self.sessions.get(request.session.session_id)
        if session is None:
            raise SessionNotFoundError(request.session.session_id)
        if session.turn_request_id is not None:
            raise InvalidRequestError(
                "session_id",
                f"session {session.session_id!r} has a turn in flight ({session.turn_request_id!r}); "
                "cancel it or close the session after it",
            )
        self.sessions.close(session.session_id)
        self._outputs.finished_requests.append(FinishedRequest(request.request_id))

    def abort_request(self, request_id: str, seq_index: int | None = None, reason: str = "cancelled") -> None:
        """Ends a request (or one of its sequences) now; what ended is published by the next step()."""
        self.requests.abort(request_id, seq_index, reason)

    def apply_abort(self, abort: AbortRequest) -> None:
        """What a stub's AbortRequest asks: a stop string's end, or an abort."""
        if abort.seq_index is not None and abort.num_output_tokens is not None:
            self.stop_sequence(abort.request_id, abort.seq_index, abort.num_output_tokens)
        else:
            self.abort_request(abort.request_id, abort.seq_index, abort.reason)

    def stop_sequence(self, request_id: str, seq_index: int, num_output_tokens: int) -> None:
        """A stop string ended a sequence after `num_output_tokens` output tokens (the stub
        found it in the text): it ends as stopped, not aborted, so a session's turn extends the
        history, with the tokens after that point (steps the core ran meanwhile) dropped."""
        record = self.requests.get(request_id)
        if record is None:  # the core ended it already (EOS, its length): a session cuts its history
            self.sessions.stop_last_turn(request_id, num_output_tokens)
            return
        if seq_index >= len(record.sequences):
            return
        seq = record.sequences[seq_index]
        if seq.is_finished:
            return
        if seq.keep_kv_owner is not None:
            self.scheduler.truncate_output(seq, num_output_tokens)
        self.requests.end_sequences(record, [seq], SequenceStatus.FINISHED_STOPPED)
        if record.is_finished:
            self.requests.close(record)

    def close(self) -> None:
        """Releases what outlives a garbage collection: the tensor-parallel workers and the grammar
        compile workers."""
        self.structured.close()
        self.runner.close()

    def abort_all(self, reason: str, request_id_prefix: str = "") -> None:
        """Ends every request (whose id starts with `request_id_prefix`)."""
        for record in self.requests:
            if record.request_id.startswith(request_id_prefix):
                self.abort_request(record.request_id, reason=reason)

    def reject(self, request_id: str, error: CoreError) -> None:
        """Publishes that a request was refused before it was queued (it never existed here)."""
        self._outputs.finished_requests.append(FinishedRequest(request_id, error))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """A step would do something now; otherwise the busy loop waits for input (or `wake`)."""
        return (
            self.scheduler.has_unfinished_sequences()
            or self._in_flight is not None
            or (len(self.requests) > self.structured.num_parked)
        )

    def wait_for_work(self, timeout_s: float) -> None:
        """For callers that step the core themselves: while only parked requests (waiting for their
        grammar) are left, block until one can start instead of spinning."""
        if not self.scheduler.has_unfinished_sequences() and self._in_flight is None:
            self.structured.wait(timeout_s)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_step_faults(self) -> int:
        """Model steps that raised, since start."""
        return self.faults.num_step_faults

    # -------------------------------------------------------------------------------------- step
    def step(self) -> EngineCoreOutputs:
        """Schedules, runs and samples one step; returns everything that happened since the last
        step() (new tokens, ends, refusals, aborts), with the scheduler's stats after it."""
        in_flight = self.launch_step()
        return self.finish_step(in_flight)

    def _defers_grammar_tokens(self) -> bool:
        """The running step was launched ahead with constrained rows: the grammars take the tokens
        of the step finishing now on its bitmask's fill thread (_start_deferred_sampling), not on
        this one (a sampled token is one its mask allowed, so the stop rules need no grammar to tell
        that an EOS ended it)."""
        return self._in_flight is not None and self._in_flight.launched.needs_sampling

    def _start_deferred_sampling(self, grammar_tokens: GrammarTokens) -> None:
        """The running step was launched ahead with constrained rows: the previous step's tokens
        are in, so its bitmask can be filled, on the fill thread while this thread applies and
        publishes them and schedules, after the grammars took `grammar_tokens` (StepBitmask.start).
        The next launch, or finish_step, samples it (sample_deferred). A fill that raises fails this
        step's requests when it filled at once (a row or two), else the next step's: the launch that
        samples this step has scheduled the next one already (new requests included; failing only
        this step's would need a way back out of schedule()). With no such step to carry them (a
        fault took it), the grammars take their tokens here."""
        in_flight = self._in_flight
        if in_flight is None or not in_flight.launched.needs_sampling:
            self._take_grammar_tokens_now(grammar_tokens)
            return
        if in_flight.launched.pending_bitmask is not None:  # started already, by finish_step
            assert not grammar_tokens, "tokens for a fill that started without them"
            return
        try:
            self.runner.start_deferred_sampling(in_flight.launched, grammar_tokens)
        except Exception as error:  # as a fault in launch_step: the step's requests fail, not the core
            self._in_flight = None
            self.faults.fail_step(in_flight.scheduler_output.scheduled, error, in_flight.step_number)

    def _take_grammar_tokens_now(self, grammar_tokens: GrammarTokens) -> None:
        try:
            grammar_tokens.take_all()
        except GrammarRejectedToken as error:  # a bug (the masks allow only what a grammar takes)
            logger.error("structured output: %s", error)

    def step_pipelined(self) -> EngineCoreOutputs:
        """One turn of the loop on an accelerator: launch step N+1, then finish step N (launched by
        the previous call) and return what it produced, with N+1 running while the caller publishes.

            launch_ahead:  launch(N+1) [reads N's tokens on the device] -> finish(N) -> return N
            otherwise:     finish(N) -> launch(N+1) -> return N

        Launching ahead needs no token value of step N on the host: it is skipped (N finished first)
        when a sequence of N samples with penalties or bad words. A step N+1 launched ahead with
        constrained rows has its bitmask filled from the moment N's tokens are on the host
        (finish_step's `start_deferred_fill`)."""
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            self.step_clock.on_idle()  # nothing ran since the last turn: the loop may have waited
        outputs = None
        if previous is not None and not self._can_launch_ahead(previous):
            outputs = self.finish_step(previous)
            previous = None
        if self.has_unfinished_requests():
            self._in_flight = self.launch_step(previous)
            if previous is not None and self._in_flight is not None:
                self.num_steps_launched_ahead += 1
        if previous is not None:
            num_faults = self.num_step_faults
            outputs = self.finish_step(previous, start_deferred_fill=self._defers_grammar_tokens())
            if self.num_step_faults > num_faults and self._in_flight is not None:
                failed = self._in_flight
                self.faults.fail_launched_after_fault(
                    failed.launched, failed.scheduler_output.scheduled, failed.step_number
                )
                self._in_flight = None
            if self._defers_grammar_tokens():  # N had none of its rows: a fill without tokens
                self._start_deferred_sampling(GrammarTokens())
        return outputs if outputs is not None else self.take_outputs()

    def finish_in_flight(self) -> EngineCoreOutputs:
        """Finishes step_pipelined's running step (if any): what it and everything before produced."""
        in_flight, self._in_flight = self._in_flight, None
        return self.finish_step(in_flight)

    @property
    def has_in_flight_step(self) -> bool:
        return self._in_flight is not None

    def _can_launch_ahead(self, previous: InFlightStep) -> bool:
        if not self.launch_ahead:
            return False
        if self.speculator is not None and self.speculator.needs_tokens_of(previous.launched):
            return False  # the next step proposes from previous' tokens: they must be on the host
        return not any(
            seq.sampling_params.needs_output_history and not seq.is_finished for seq in previous.launched.seqs
        )

    def launch_step(self, previous: InFlightStep | None = None) -> InFlightStep | None:
        """The first half of step(): schedule and enqueue the device work (returns at once on an
        accelerator). The caller may do host work (e.g. detokenize the previous step) before
        finish_step(); aborts in between are fine: the step's results for them are dropped, and
        their blocks are only reused by a later schedule(), after this step's sync (or, on the
        device, after this step in stream order). `previous`: a launched step not finished yet,
        whose sampled tokens this step takes as inputs on the device (asynchronous scheduling)."""
        self._start_parked()
        expire_deadlines(self.requests)
        self.sessions.expire_idle()
        if self.config.scheduler.queue_max_wait_s > 0.0:
            expire_queue_waits(self.requests, self.scheduler.waiting, self.config.scheduler.queue_max_wait_s)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return None
        self.num_steps += 1
        try:
            if self.config.fault_injection_step == self.num_steps:
                raise RuntimeError(f"injected fault at step {self.num_steps} (fault_injection_step)")
            launched = self.runner.launch(scheduler_output, previous.launched if previous else None)
            self.scheduler.on_launched(scheduler_output)
            return InFlightStep(scheduler_output, launched, self.num_steps)
        except TensorParallelError:
            raise  # no step can run any more: the core stops
        except Exception as error:  # a model fault must not take the server down
            self.faults.fail_step(scheduler_output.scheduled, error, self.num_steps)
            return None

    def _start_parked(self) -> None:
        """Starts the requests whose grammar compiled (or fails those whose grammar did not)."""
        for ready in self.structured.take_ready():
            record = ready.record
            if self.requests.get(record.request_id) is not record:
                continue  # ended while it waited (abort, deadline)
            if ready.error is not None:
                self.requests.close(record, ready.error)
            else:
                self.requests.start_parked(record)

    def finish_step(
        self, in_flight: InFlightStep | None, start_deferred_fill: bool = False
    ) -> EngineCoreOutputs:
        """The second half of step(): wait for the device, apply the sampled tokens, publish.
        `start_deferred_fill`: the step launched ahead of this one has constrained rows; as soon as
        this step's tokens are in, its bitmask fill starts, the grammars taking those tokens first
        on the fill thread (_start_deferred_sampling), so the fill runs under this step's update
        and publishing (the update then leaves the grammars alone)."""
        if in_flight is not None:
            try:
                if in_flight.launched.needs_sampling:  # not launched on: sampled here
                    self.runner.sample_deferred(in_flight.launched)
                runner_output = in_flight.launched.result()
            except Exception as error:
                self.faults.fail_step(in_flight.scheduler_output.scheduled, error, in_flight.step_number)
            else:
                if start_deferred_fill:
                    self._start_deferred_sampling(
                        sampled_grammar_tokens(in_flight.scheduler_output, runner_output.sampled_token_ids)
                    )
                updates = self.scheduler.update_from_output(
                    in_flight.scheduler_output,
                    runner_output.sampled_token_ids,
                    runner_output.spec_token_ids,
                    defer_grammar_tokens=start_deferred_fill,
                )
                if runner_output.spec_token_ids:
                    Speculator.on_verified(runner_output.spec_token_ids, self.scheduler.sequences)
                self._publish_updates(updates, runner_output)
                self.step_clock.on_step_finished(in_flight.scheduler_output)
        if in_flight is None or not self.scheduler.has_unfinished_sequences():
            self.step_clock.on_idle()  # the next step comes after a wait for work (any driver)
        return self.take_outputs()

    def take_outputs(self) -> EngineCoreOutputs:
        """What happened since the last call (the busy loop also calls it after handling input)."""
        self.lora_updates.forget_unused()
        outputs, self._outputs = self._outputs, EngineCoreOutputs()
        outputs.scheduler_stats = self.scheduler_stats()
        outputs.session_stats = self.sessions.stats()
        outputs.num_steps = self.num_steps
        outputs.num_step_faults = self.num_step_faults
        outputs.gc_pauses = process_gc_pauses()
        outputs.step_times = self.step_clock.totals
        outputs.structured_output_stats = self.structured.take_stats(self.runner.bitmask_times())
        return outputs

    def _publish_updates(self, updates: list[SequenceUpdate], runner_output: ModelRunnerOutput) -> None:
        out = self._outputs
        for update in updates:
            seq, token_id = update.seq, update.new_token_id
            if token_id is None:
                continue  # a prefill chunk
            owner = self.requests.owner(seq.seq_id)
            assert owner is not None, f"{seq.seq_id}: an update for a sequence no request owns"
            record, index = owner
            if update.new_token_ids is not None:  # verified proposals: every emitted token, in order
                for earlier in update.new_token_ids[:-1]:
                    out.request_ids.append(record.request_id)
                    out.seq_indices.append(index)
                    out.new_token_ids.append(earlier)
            row = len(out.request_ids)
            out.request_ids.append(record.request_id)
            out.seq_indices.append(index)
            out.new_token_ids.append(token_id)
            logprobs = runner_output.logprobs.get(seq.seq_id)
            if logprobs is not None:
                out.logprobs[row] = logprobs
            if record.unstarted and index == 0:
                self.requests.start_siblings(record)  # the prompt's KV is computed: share it
            if seq.is_finished:
                self.structured.on_finished(seq)
                self.requests.finished(record, index)
                stop_reason = seq.stop_reason if isinstance(seq.stop_reason, int) else None
                out.finished_sequences.append(
                    FinishedSequence(
                        record.request_id, index, seq.status.finish_reason or "abort", stop_reason
                    )
                )
                if record.is_finished:
                    self.requests.close(record)

    # ---------------------------------------------------------------------------------- utility
    def record_utility_result(self, call_id: int, result: tuple[bool, object]) -> None:
        self._outputs.utility_results[call_id] = result

    def scheduler_stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        lora = self.runner.lora
        if lora is None:
            return stats
        return replace(
            stats,
            lora_loads_total=lora.num_loads,
            lora_evictions_total=lora.num_evictions,
            num_lora_slots_used=lora.num_slots_used,
        )

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    def load_lora_adapter(self, name: str, path: str) -> tuple[str, ...]:
        """Serves LoRA adapter `name` from `path` from now on; the adapters a request may name."""
        return self.lora_updates.load(name, path)

    def _live_sequences(self) -> Iterator[Sequence]:
        """Every sequence a request has: scheduled (running, waiting, preempted), a later sample
        not started yet, or one parked while its grammar compiles."""
        yield from self.scheduler.sequences.values()
        for record in self.requests:
            yield from record.unstarted
            if record.parked is not None:
                yield record.parked

    def _forget_lora_kv(self, lora_name: str) -> None:
        """An unloaded adapter's KV must not serve one loaded later under its name: its sessions' KV
        goes. (Its prefix-cache blocks are keyed by the load, Sequence.lora_load_id: a later load
        never matches them, and they age out of the cache like any other.)"""
        self.sessions.forget_adapter(lora_name)

    def lora_adapter_names(self) -> tuple[str, ...]:
        return self.info.lora_names

    def unload_lora_adapter(self, name: str) -> tuple[str, ...]:
        """Refuses new requests for `name`; its requests in flight finish with it."""
        return self.lora_updates.unload(name)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity(self.sessions.kv_holders)
        self.sessions.check_integrity()
        self.requests.check_integrity()
