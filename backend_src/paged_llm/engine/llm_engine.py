"""LLMEngine: the synchronous engine API for offline use, tests and debugging.

    engine = LLMEngine(config)                       # core stepped in this process (no thread)
    engine = LLMEngine(config, core_mode="process")  # the same core in its own process
    engine = LLMEngine(config, core_mode="auto")     # process on an accelerator, inprocess on a CPU
    engine.add_request("r0", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for output in engine.step(): ...             # RequestOutputs: text deltas, finish reasons

It is the stub side (tokenizer, OutputProcessor) without Triton, over an engine core client. Serving uses the
same pieces through engine/async_llm.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from paged_llm.config import EngineConfig
from paged_llm.core.scheduler import SchedulerStats
from paged_llm.core.sessions import SessionTurn
from paged_llm.engine.core_client import (
    PARKED_WAIT_S,
    InProcessCoreClient,
    resolve_core_mode,
    start_core_and_tokenizer,
)
from paged_llm.engine.core_types import AbortRequest, EngineCoreOutputs, EngineCoreRequest, utility_error
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.outputs import RequestOutput
from paged_llm.engine.stats import EngineStats
from paged_llm.engine.validation import validate_params, validate_prompt
from paged_llm.errors import RequestAbortedError
from paged_llm.sampling.bad_words import with_bad_words_tokenized
from paged_llm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(
        self, config: EngineConfig, show_progress: bool = True, core_mode: str = "inprocess"
    ) -> None:
        self.config = config
        self.core_mode = resolve_core_mode(config, core_mode)  # never "auto"
        self.client, self.tokenizer = start_core_and_tokenizer(config, self.core_mode, show_progress)
        self.info = self.client.info
        self.stats = EngineStats()
        self.processor = OutputProcessor(self.tokenizer, self.stats)
        self._backlog: list[RequestOutput] = []  # outputs read while waiting for a utility call

    @property
    def core(self) -> Any:
        """The EngineCore itself (in-process mode only): scheduler, KV cache, runner, for tests."""
        if not isinstance(self.client, InProcessCoreClient):
            raise AttributeError("the engine core runs in another process or thread")
        return self.client.core

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        deadline: float | None = None,
        arrival_time: float | None = None,
        session: SessionTurn | None = None,
    ) -> None:
        """Validates and queues a request; InvalidRequestError if it can never be served,
        QueueFullError if it is refused for load. `arrival_time`: time.monotonic() when it arrived
        (default now; queue_max_wait_s counts from it). `session`: the request is a turn of that
        session and `prompt_token_ids` only its new tokens (none, with `session.end`: close it)."""
        prompt = list(prompt_token_ids)
        params = with_bad_words_tokenized(params, self.tokenize)
        if session is None or not session.closes_only(prompt):
            validate_prompt(self.info, prompt)
        validate_params(self.info, params)
        if arrival_time is None:
            arrival_time = time.monotonic()
        core_id = self.processor.add_request(request_id, prompt, params, arrival_time, session is not None)
        try:
            self.client.add_request(
                EngineCoreRequest(core_id, prompt, params, arrival_time, deadline, session)
            )
        except BaseException:
            self.processor.remove_request(request_id)
            raise

    def abort_request(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        """Ends a request now; returns its final output, whose error says why (None if unknown)."""
        core_id = self.processor.core_request_id(request_id)
        if core_id is None:
            return None
        output = self.processor.abort_request(request_id, RequestAbortedError(reason))
        self.client.abort_requests([AbortRequest(core_id, None, reason)])
        return output

    def has_unfinished_requests(self) -> bool:
        """True until every request's final output was returned by step() (a request whose end is
        still in an unprocessed step counts as unfinished in the processor)."""
        return self.processor.has_unfinished_requests() or bool(self._backlog)

    def step(self) -> list[RequestOutput]:
        """Waits for the next engine step and returns the RequestOutputs it produced."""
        if self._backlog:
            outputs, self._backlog = self._backlog, []
            return outputs
        if isinstance(self.client, InProcessCoreClient) and self.client.core.pipelined:
            return self._step_overlapped(self.client.core)  # on a CPU the step itself is the host work
        core_outputs = self.client.get_outputs(timeout_s=None)
        return self._absorb(core_outputs) if core_outputs is not None else []

    def _step_overlapped(self, core: Any) -> list[RequestOutput]:
        """In-process: the core returns step N with step N+1 running (EngineCore.step_pipelined), and
        N is detokenized while the device runs N+1. A stop string found in step N aborts its
        sequence with N+1 in flight; N+1's token for it is dropped."""
        core.wait_for_work(PARKED_WAIT_S)
        finished = core.step_pipelined()
        return self._absorb(finished) if not finished.is_empty else []

    def _absorb(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        touched, aborts = self.processor.process(core_outputs)
        if aborts:
            self.client.abort_requests(aborts)
        return self.processor.collect(sorted(touched))

    def call_utility(self, name: str, *args: Any) -> Any:
        """Runs EngineCore.<name>(*args) between two core steps and returns its result."""
        if isinstance(self.client, InProcessCoreClient):
            return getattr(self.client.core, name)(*args)
        call_id = self.client.send_utility(name, *args)
        while True:
            core_outputs = self.client.get_outputs(timeout_s=None)
            if core_outputs is None:
                continue
            result = core_outputs.utility_results.pop(call_id, None)
            self._backlog.extend(self._absorb(core_outputs))
            if result is not None:
                ok, value = result
                if not ok:
                    raise utility_error(name, value)
                return value

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serves LoRA adapter `name` (a PEFT checkpoint at `path`) from now on (the core's
        allow_runtime_lora_updates); InvalidRequestError in process, an error otherwise."""
        self.info.lora_names = self.call_utility("load_lora_adapter", name, str(path))

    def unload_lora_adapter(self, name: str) -> None:
        """New requests for `name` are refused from now on; those in flight finish with it."""
        self.info.lora_names = self.call_utility("unload_lora_adapter", name)

    def scheduler_stats(self) -> SchedulerStats:
        """The core's scheduler counters now (KV usage, preemptions, prefix-cache hits)."""
        return self.call_utility("scheduler_stats")

    def check_integrity(self) -> None:
        self.processor.check_integrity()
        self.call_utility("check_integrity")

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
