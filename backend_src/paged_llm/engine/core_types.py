"""The messages between the stub side (tokenizer, detokenizer, Triton) and the engine core.

They cross a process boundary once per request (`EngineCoreRequest`) and once per engine step
(`EngineCoreOutputs`), so the per-step message is columnar: one object whose fields are lists with a
row per sequence that advanced. Pickling that costs ~30 us for 256 rows, against ~750 us for 256
small row objects (measured: docs/benchmarks.md, "Engine core IPC"). No torch types in here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.scheduler import SchedulerStats
from paged_llm.core.sessions import SessionStats, SessionTurn
from paged_llm.engine.step_times import StepTimes
from paged_llm.errors import InvalidRequestError
from paged_llm.gc_pauses import GcPauses
from paged_llm.sampling.token_logprobs import TokenLogprobs
from paged_llm.sampling_params import SamplingParams


@dataclass
class EngineCoreInfo:
    """What the core tells the stub once the model is loaded and the KV pool sized."""

    model_dir: str  # the resolved checkpoint directory (the stub loads its tokenizer from here)
    architecture: str  # e.g. Qwen3ForCausalLM
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_model_len: int  # prompt + output tokens of one sequence (lowered to what the pool holds)
    num_kv_blocks: int
    block_size_tokens: int
    eos_token_ids: frozenset[int]
    device: str  # human-readable, for logs
    dtype: str
    lora_names: tuple[str, ...] = ()  # the LoRA adapters a request may name (lora_name)
    lora_runtime_updates: bool = False  # adapters load and unload while serving (lora_names changes)


@dataclass
class CoreStartupFailed:
    """Sent instead of EngineCoreInfo when the core could not start (bad config, load failure)."""

    message: str
    is_config_error: bool  # a ConfigError: the user's settings, not a crash


@dataclass
class EngineCoreRequest:
    """One client request (it may fan out to `params.n` sequences)."""

    request_id: str  # unique among in-flight requests; chosen by the stub
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the stub accepted it (shared clock on Linux)
    deadline: float | None = None  # time.monotonic() after which the core aborts it
    session: SessionTurn | None = None  # a turn of a session: the prompt is only the new tokens


@dataclass
class AbortRequest:
    """Ends a request (`seq_index` None) or one of its sequences: a stop string matched in it after
    `num_output_tokens` output tokens (the sequence stops there, as if a stop token had ended it; the
    core may have run a step or two further, and a session's history keeps just those tokens)."""

    request_id: str
    seq_index: int | None = None
    reason: str = "cancelled"
    num_output_tokens: int | None = None


@dataclass
class UtilityCall:
    """Runs `EngineCore.<name>()` between two steps; the answer comes back in `utility_results`."""

    call_id: int
    name: str  # one of EngineCore.UTILITY_CALLS
    args: tuple[Any, ...] = ()  # its positional arguments (plain data)


def utility_error(name: str, value: object) -> Exception:
    """The error of a failed UtilityCall's value: InvalidRequestError for a refused input."""
    if isinstance(value, tuple) and len(value) == 2:
        return InvalidRequestError(*value)
    return RuntimeError(f"engine core {name}: {value}")


@dataclass
class Shutdown:
    """From the stub that started the core: stop. From an attached one: it detaches."""

    reason: str = "shutdown requested"


@dataclass
class AttachStub:
    """The first message of a further stub (another Triton instance of the same model on the
    same device) that shares a running core instead of starting its own (engine/engine_core/stub_links.py)."""

    pid: int


@dataclass
class StubAttached:
    """The core's answer to AttachStub: the attached stub's request ids start with
    `request_id_prefix`, which is how the core routes their outputs back to it."""

    info: EngineCoreInfo
    stub_id: int  # >= 1; the stub that started the core is 0

    @property
    def request_id_prefix(self) -> str:
        return f"{self.stub_id}:"


@dataclass
class AbortStub:
    """An attached stub went away: end every request whose id starts with `request_id_prefix`."""

    request_id_prefix: str
    reason: str


CoreInput = EngineCoreRequest | AbortRequest | UtilityCall | AbortStub | Shutdown


@dataclass
class FinishedSequence:
    request_id: str
    seq_index: int
    finish_reason: str  # "stop" | "length" | "abort" (vLLM's strings; engine faults report "abort")
    stop_reason: int | None = None  # the EOS / stop token id that ended it


@dataclass
class CoreError:
    """Why a request failed inside the core; the stub turns `kind` into a typed error."""

    kind: str  # "invalid_arg" | "unavailable" | "not_found" | "aborted" | "internal"
    message: str
    field: str | None = None  # for invalid_arg: the input the client must fix


@dataclass
class FinishedRequest:
    """The core forgot this request: every sequence ended, or it failed (`error`)."""

    request_id: str
    error: CoreError | None = None


@dataclass
class StructuredOutputStats:
    """Structured output in the core, since start (the compile times: since the last publish)."""

    requests_by_kind: dict[str, int] = field(default_factory=dict)  # constrained requests per kind
    num_compiles: int = 0  # grammars compiled (cache misses that compiled)
    num_compile_errors: int = 0  # constraints that did not compile (the request failed)
    num_compile_timeouts: int = 0  # compiles that overran grammar_compile_timeout_s
    num_cache_hits: int = 0  # constrained requests whose grammar was compiled already
    num_length_in_grammar: int = 0  # constrained sequences ended by max_tokens / max_model_len mid-grammar
    num_mask_fills: int = 0  # steps whose grammar bitmask was filled
    mask_fill_seconds: float = 0.0  # the time of those fills (on the fill thread or the engine's)
    mask_wait_seconds: float = 0.0  # the engine thread's waits for a fill on the fill thread
    compile_seconds: list[float] = field(default_factory=list)  # each compile's time, since the last publish


@dataclass
class EngineCoreOutputs:
    """Everything one core step produced. Rows: one per sequence that got a new token.

    row:             0        1        2
    request_ids:    ["7",    "7",     "9"]
    seq_indices:    [ 0,      1,       0 ]     (request 7 has n=2)
    new_token_ids:  [ 1234,   88,      5 ]
    """

    request_ids: list[str] = field(default_factory=list)
    seq_indices: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # row -> logprobs, when asked
    finished_sequences: list[FinishedSequence] = field(default_factory=list)
    finished_requests: list[FinishedRequest] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None  # after this step
    session_stats: SessionStats | None = None
    # request id -> history tokens its session dropped to fit the turn (attention-sink truncation)
    history_truncated: dict[str, int] = field(default_factory=dict)
    num_step_faults: int = 0  # model steps that raised, since start
    gc_pauses: GcPauses | None = None  # the core process's garbage-collection pauses, since start
    utility_results: dict[int, tuple[bool, object]] = field(default_factory=dict)  # call id -> (ok, value)
    num_steps: int = 0  # engine steps taken so far (the first step is 1)
    structured_output_stats: StructuredOutputStats | None = None
    step_times: StepTimes | None = None  # the core's busy step periods, since start

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def is_empty(self) -> bool:
        compiles = self.structured_output_stats is not None and self.structured_output_stats.compile_seconds
        return not (
            self.request_ids
            or self.finished_sequences
            or self.finished_requests
            or self.utility_results
            or compiles  # observations the stub's histogram would otherwise never get
        )
