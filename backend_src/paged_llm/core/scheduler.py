"""Continuous batching under a per-step token budget, with chunked prefill and preemption by recompute.

Each step:
  1. Running requests, best (priority, arrival) first, get what they still lack
     (`num_tokens - num_computed_tokens`: 1 for a decode, the rest of the prompt for a chunked prefill),
     capped by the remaining token budget. When the pool is short, the worst running request that
     has not been scheduled this step is preempted (its blocks freed; it is recomputed on resume).
  2. If nothing was preempted, waiting requests are admitted in (priority, arrival) order, served
     first from the prefix cache, while the budget, `max_num_seqs` and the pool allow.
After the runner executed the step, `update_from_output` advances `num_computed_tokens`, registers
newly full blocks in the prefix cache, appends sampled tokens and finishes requests.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from paged_llm.config import SchedulerConfig
from paged_llm.core.kv_cache_manager import KVCacheManager
from paged_llm.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request  # the live request (the runner reads its tokens and sampling params)
    num_computed_tokens: int  # tokens with KV before this step = position of the first new token
    num_new_tokens: int  # tokens computed this step: all_token_ids[start : start + num_new_tokens]
    block_ids: list[int]  # the request's whole block table (live view; read before the next schedule)
    needs_sample: bool  # this chunk reaches the last known token, so the step samples a new one

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    preempted: list[Request] = field(default_factory=list)  # preempted during this schedule()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests
    num_preemptions_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # Without chunking a sequence must be (re)computed in one step: a prompt, or a preempted
            # request's prompt + output, longer than the budget could never be scheduled.
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled"
            )
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by schedule_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._next_arrival_seq = 0
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        assert request.num_prompt_tokens >= 1 and request.num_tokens <= self.max_model_len
        if request.arrival_seq < 0:
            request.arrival_seq = self._next_arrival_seq
            self._next_arrival_seq += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (abort, stop string, timeout, error): frees their blocks, forgets them."""
        assert status.is_finished
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self._remove_waiting(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]

    # ----------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.schedule_key)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            while self.kv_cache.allocate_slots(request, num_new) is None:
                # Worst request not yet scheduled this step: running[index:] is sorted best first.
                victim = self.running[-1]
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; running[index] is now the next request
            self._add_scheduled(output, request, request.num_computed_tokens, num_new)
            budget -= num_new
            index += 1

        if not output.preempted:
            budget = self._admit_waiting(output, budget)
        output.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return output

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request in output.preempted:
                break  # preempted this very step to make room: resuming it now would only thrash
            if len(self.running) >= self.config.max_num_seqs:
                budget, made_room = self._preempt_lower_priority(request, output, budget)
                if not made_room:
                    break
                continue
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv_cache.allocate_slots(request, num_new, hit_blocks) is None:
                # FCFS: the head waits for blocks rather than being overtaken, unless it outranks a
                # running request.
                budget, made_room = self._preempt_lower_priority(request, output, budget)
                if not made_room:
                    break
                continue
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_prompt_tokens = num_hit_tokens
            self.running.append(request)
            self._add_scheduled(output, request, num_hit_tokens, num_new)
            budget -= num_new
        return budget

    def _preempt_lower_priority(
        self, request: Request, output: SchedulerOutput, budget: int
    ) -> tuple[int, bool]:
        """Preempts the worst running request if `request` strictly outranks it (lower priority value).

        The victim may already be scheduled in this step: it is taken out of the step and its tokens
        go back to the budget. (Its blocks hold no cache entries yet for this step's tokens: those are
        registered only after a step ran.) Returns the new budget and whether room was made.
        """
        candidates = [r for r in self.running if r.priority > request.priority]
        if not candidates:
            return budget, False
        victim = max(candidates, key=lambda r: r.schedule_key)
        for position, item in enumerate(output.scheduled):
            if item.request is victim:
                budget += item.num_new_tokens
                del output.scheduled[position]
                break
        self._preempt(victim)
        output.preempted.append(victim)
        return budget, True

    def _add_scheduled(self, output: SchedulerOutput, request: Request, start: int, num_new: int) -> None:
        output.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=start,
                num_new_tokens=num_new,
                block_ids=self.kv_cache.block_ids_view(request.request_id),
                needs_sample=start + num_new == request.num_tokens,
            )
        )

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free the KV, keep every token, resume from scratch later."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [r.schedule_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.schedule_key), request)

    def _remove_waiting(self, request: Request) -> None:
        self.waiting.remove(request)

    # ------------------------------------------------------------------------------------ update
    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> list[tuple[Request, int | None]]:
        """Applies a finished step: returns (request, new token or None) for each scheduled request.

        Requests that finished here (EOS, stop token, max_tokens, max_model_len) are already freed.
        """
        updates: list[tuple[Request, int | None]] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue  # finished between schedule() and now (abort); nothing to apply
            request.num_computed_tokens += scheduled.num_new_tokens
            self.kv_cache.cache_computed_blocks(request)
            if not scheduled.needs_sample:
                updates.append((request, None))
                continue
            token_id = sampled_token_ids[request.request_id]
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updates.append((request, token_id))
        return updates

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        # The token just appended has index num_output_tokens - 1; stop tokens count from index
        # min_tokens on (the sampler suppresses them before that).
        if request.num_output_tokens > params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------------------------- state
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv_cache.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queried_tokens=self.kv_cache.num_prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv_cache.num_prefix_hit_tokens,
        )

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting)
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "registry out of sync with the queues"
        assert set(self.kv_cache.req_to_blocks) <= running_ids, "a non-running request holds blocks"
        keys = [r.schedule_key for r in self.waiting]
        assert keys == sorted(keys), "waiting queue out of order"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens <= self.max_model_len
            num_blocks = len(self.kv_cache.req_to_blocks.get(request.request_id, []))
            assert num_blocks >= self.kv_cache.num_blocks_for_tokens(request.num_computed_tokens)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
