"""Engine configuration: frozen dataclasses, validated once, built from config.pbtxt parameters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from paged_llm.coercion import parse_bool, parse_float, parse_int
from paged_llm.sampling_params import MAX_LORA_NAME_CHARS, RequestLimits

GiB = 1 << 30


class ConfigError(ValueError):
    """A bad engine setting (config.pbtxt); the model fails to load with this message."""


@dataclass(frozen=True)
class ModelConfig:
    model: str = "tiny-qwen3"  # a checkpoint directory, or the name of a built-in model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: checkpoint dtype on GPU, fp32 on CPU)
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0  # seeds the per-request seeds drawn for requests that give none
    # safetensors: the checkpoint's weights | dummy: random weights drawn on the device, for
    # benchmarking a shape whose checkpoint is too large to write (only config.json is read).
    load_format: str = "safetensors"
    # "": what the checkpoint's config.json says (FP8 layouts: models/fp8.py) | fp8: also quantize an
    # unquantized checkpoint's projections at load (per channel)
    quantization: str = ""

    def __post_init__(self) -> None:
        if self.quantization not in ("", "fp8"):
            raise ConfigError(f"quantization must be fp8 or empty, got {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ConfigError(f"load_format must be safetensors or dummy, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size_tokens: int = 16
    num_blocks: int | None = None  # explicit pool size; else derived from a memory budget
    memory_bytes: int | None = None  # KV memory budget in bytes
    gpu_memory_utilization: float = 0.9  # on accelerators: fraction of device memory for weights+KV
    cpu_memory_bytes: int = 1 * GiB  # on CPU, when neither num_blocks nor memory_bytes is given
    enable_prefix_caching: bool = True
    # auto: the model dtype | fp8 (fp8_e4m3): e4m3 entries, each key / value divided by its layer's
    # scale (the checkpoint's k_scale / v_scale, else 1.0): half the bytes, twice the tokens
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ConfigError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.block_size_tokens < 1 or self.block_size_tokens > 1024:
            raise ConfigError(f"block_size_tokens must be in [1, 1024], got {self.block_size_tokens}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ConfigError(f"kv_cache_memory_bytes must be >= 1, got {self.memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True
    max_queued_requests: int = 4096  # waiting requests beyond this are refused (UNAVAILABLE)
    # While sequences decode, prefill gets at most this many tokens of a step (0: no separate limit,
    # only max_num_batched_tokens); bounds inter-token latency when prompts keep arriving.
    max_prefill_tokens_while_decoding: int = 0
    # queue: a request that cannot start yet waits (up to max_queued_requests of them); reject: it is
    # refused at once (UNAVAILABLE) when max_num_seqs sequences are already live.
    admission_policy: str = "queue"
    # A request still waiting to start after this many seconds ends with UNAVAILABLE and never runs
    # (0: it waits as long as it takes).
    queue_max_wait_s: float = 0.0
    # Schedule and launch step N+1 before step N's tokens reach the host, so that the device never
    # waits for the host's scheduling (vLLM's async scheduling). auto: on for accelerators, off on
    # CPU (where a step is computed when it is launched, so nothing would overlap).
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding < 0:
            value = self.max_prefill_tokens_while_decoding
            raise ConfigError(f"max_prefill_tokens_while_decoding must be >= 0, got {value}")
        if self.max_queued_requests < 1:
            raise ConfigError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.admission_policy not in ("queue", "reject"):
            raise ConfigError(f"admission_policy must be queue or reject, got {self.admission_policy!r}")
        if not self.queue_max_wait_s >= 0.0:  # also refuses NaN
            raise ConfigError(f"queue_max_wait_s must be >= 0, got {self.queue_max_wait_s}")


@dataclass(frozen=True)
class SessionConfig:
    """Multi-turn sessions (core/sessions.py)."""

    max_sessions: int = 1024  # open sessions; starting one more is refused (UNAVAILABLE)
    session_idle_ttl_s: float = 600.0  # a session without a turn for this long is closed (0: never)
    session_window_tokens: int = 0  # history + turn + max_tokens kept per turn (0: max_model_len)
    num_sink_tokens: int = 4  # first history tokens always kept when the history is truncated

    def __post_init__(self) -> None:
        if self.max_sessions < 0:
            raise ConfigError(f"max_sessions must be >= 0, got {self.max_sessions}")
        if not self.session_idle_ttl_s >= 0.0:
            raise ConfigError(f"session_idle_ttl_s must be >= 0, got {self.session_idle_ttl_s}")
        if self.session_window_tokens < 0:
            raise ConfigError(f"session_window_tokens must be >= 0, got {self.session_window_tokens}")
        if self.num_sink_tokens < 0:
            raise ConfigError(f"num_sink_tokens must be >= 0, got {self.num_sink_tokens}")


MULTI_LORA_FILE = "multi_lora.json"  # vllm_backend's adapter list, in the model's version directory


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (lora/): a request names one (`lora_name`)."""

    # NAME=PATH pairs (PEFT checkpoint directories), separated by commas or spaces
    lora_modules: str = ""
    max_loras: int = 8  # adapters a step may serve at once (device slots)
    max_lora_rank: int = 64  # the largest rank an adapter may have (the slots' width)
    # adapters kept in host memory, least recently used dropped and read again from disk when a
    # step needs it (0: every one)
    max_cpu_loras: int = 0
    # adapters may be loaded and unloaded while serving (vLLM's runtime LoRA updating): the slots
    # are then sized for max_loras adapters of max_lora_rank from the start
    allow_runtime_lora_updates: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= 256:
            raise ConfigError(f"max_loras must be in [1, 256], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 1024:
            raise ConfigError(f"max_lora_rank must be in [1, 1024], got {self.max_lora_rank}")
        if self.max_cpu_loras < 0:
            raise ConfigError(f"max_cpu_loras must be 0 (every adapter) or more, got {self.max_cpu_loras}")
        self.modules()  # raises on a malformed list

    def modules(self) -> dict[str, str]:
        """Adapter name -> checkpoint directory, in the order given."""
        named: dict[str, str] = {}
        for item in self.lora_modules.replace(",", " ").split():
            name, sep, path = item.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise ConfigError(f"lora_modules: {item!r} is not NAME=PATH")
            if "=" in path:
                raise ConfigError(f"lora_modules: {item!r}: the path has an '=' (a missing space?)")
            if len(name) > MAX_LORA_NAME_CHARS:
                raise ConfigError(f"lora_modules: a name is over {MAX_LORA_NAME_CHARS} characters")
            if name in named:
                raise ConfigError(f"lora_modules: the name {name!r} is given twice")
            named[name] = path
        return named

    @property
    def enabled(self) -> bool:
        return bool(self.lora_modules.strip()) or self.allow_runtime_lora_updates

    def with_multi_lora_json(self, version_dir: Path) -> LoRAConfig:
        """This config plus the adapters of vllm_backend's `multi_lora.json` in the model's version
        directory ({"NAME": "PATH", ...}), if there is one. A relative PATH is taken from the server's
        working directory where it exists there (as vllm_backend does), else from `version_dir`."""
        path = version_dir / MULTI_LORA_FILE
        if not path.is_file():
            return self
        try:
            named = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path}: not readable JSON: {error}") from None
        if not isinstance(named, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in named.items()
        ):
            raise ConfigError(f'{path}: expected an object of adapter names and paths {{"NAME": "PATH"}}')
        items = [self.lora_modules]
        for name, raw in named.items():
            if any(c.isspace() or c in ",=" for c in name):
                raise ConfigError(f"{path}: adapter name {name!r} has a space, comma or '='")
            if any(c.isspace() or c in ",=" for c in raw):
                raise ConfigError(f"{path}: the path of adapter {name!r} has a space, comma or '='")
            adapter_dir = Path(raw).expanduser()
            if not adapter_dir.is_absolute() and not adapter_dir.exists():
                adapter_dir = version_dir / adapter_dir
            items.append(f"{name}={adapter_dir.resolve()}")
        return replace(self, lora_modules=" ".join(item for item in items if item))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (spec_decode/): a proposer guesses up to `num_speculative_tokens` next
    tokens of a decoding sequence and one target step scores them all (vLLM's speculative_config)."""

    # ngram: prompt lookup in the sequence's own tokens; draft_model: a smaller checkpoint with the
    # same vocabulary (`speculative_model`) proposes greedily
    speculative_method: str = "ngram"
    speculative_model: str = ""  # the draft checkpoint directory (or a built-in model's name)
    num_speculative_tokens: int = 0  # k, proposed tokens per step and sequence (0: off)
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up (ngram)
    prompt_lookup_min: int = 1  # shortest
    # When a step's verifying sequences accepted fewer proposals than this on average, proposing
    # pauses (1 step, then 2, 4, ... up to 64 while it keeps not paying; steps are launched ahead
    # again meanwhile); 0: never pause.
    speculative_pause_below: float = 0.5

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.speculative_method!r}"
            )
        if self.speculative_method == "draft_model" and not self.speculative_model:
            raise ConfigError("speculative_method draft_model needs speculative_model (a checkpoint)")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if not 0.0 <= self.speculative_pause_below <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_pause_below must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.speculative_pause_below}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Grammar-constrained decoding (structured_output/): where and how constraints compile."""

    # Compiles that run at once, on threads of the core (constraints up to grammar_inprocess_max_bytes)
    # or in as many worker processes (larger ones: one that overruns its cap is killed).
    grammar_compile_workers: int = 2
    grammar_inprocess_max_bytes: int = 16384
    grammar_compile_threads: int = 8  # xgrammar's threads per compile (at most the cores)
    # A compile that takes longer fails its request (INVALID_ARG); the others are not held up.
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_entries: int = 512  # compiled grammars kept (least recently used dropped)
    # xgrammar threads that fill a step's token bitmask, off the engine's thread (0: one per 4 usable
    # cores, up to 4). On a host whose cores the server's other processes keep busy, fewer threads
    # leave the engine's thread its core.
    grammar_fill_threads: int = 0
    # JSON between tokens, where a request does not say (structured_outputs.disable_any_whitespace):
    # compact = the standard separators and no other whitespace (a model cannot wander in
    # whitespace); any = whatever whitespace the model writes.
    structured_output_whitespace: str = "compact"

    def __post_init__(self) -> None:
        if not 1 <= self.grammar_compile_workers <= 64:
            raise ConfigError(
                f"grammar_compile_workers must be in [1, 64], got {self.grammar_compile_workers}"
            )
        if not self.grammar_compile_timeout_s > 0.0:
            raise ConfigError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.grammar_inprocess_max_bytes < 0:
            raise ConfigError(
                f"grammar_inprocess_max_bytes must be >= 0, got {self.grammar_inprocess_max_bytes}"
            )
        if not 1 <= self.grammar_compile_threads <= 256:
            raise ConfigError(
                f"grammar_compile_threads must be in [1, 256], got {self.grammar_compile_threads}"
            )
        if not 0 <= self.grammar_fill_threads <= 64:
            raise ConfigError(f"grammar_fill_threads must be in [0, 64], got {self.grammar_fill_threads}")
        if self.grammar_cache_entries < 1:
            raise ConfigError(f"grammar_cache_entries must be >= 1, got {self.grammar_cache_entries}")
        if self.structured_output_whitespace not in ("compact", "any"):
            raise ConfigError(
                "structured_output_whitespace must be compact or any, "
                f"got {self.structured_output_whitespace!r}"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


TORCH_COMPILE_MODES = ("", "default", "max-autotune")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda | npu (optionally with an index, e.g. cuda:1)
    enable_cuda_graphs: bool = True
    # A Triton GEMV for the linear layers of one-row batches (batch-1 decode), 16-bit dtypes, CUDA.
    enable_triton_gemv: bool = True
    # CPU, float32: linear layers of 512+ inputs through oneDNN instead of MKL (layers/cpu_linear.py;
    # 1.6-2.0x at batch-1 decode on the 2-core VM). Logits move by ~1e-6 relative against F.linear's.
    enable_onednn_linear: bool = True
    # CUDA: torch.compile (Inductor) generates the decode step's kernels instead of our Triton
    # elementwise and GEMV kernels (attention stays ours), then the decode graphs capture what it
    # built: "" (off), "default" or "max-autotune" (Inductor's mode, without its own CUDA graphs).
    # Prefill and mixed steps keep our kernels. A measured alternative (docs/benchmarks.md), slower
    # than the hand-written kernels there; not with tensor parallelism.
    torch_compile: str = ""
    # Devices one engine spreads the model over (Megatron-style sharding, NCCL on CUDA, gloo on
    # CPU): `device` and the next tensor_parallel_size - 1 devices, one worker process per extra one.
    tensor_parallel_size: int = 1
    # Tensor parallelism's all-reduce: auto = a one-shot all-reduce over peer-to-peer symmetric
    # memory for small tensors (decode steps; CUDA, bfloat16/float32), NCCL for the rest; nccl =
    # NCCL for every one.
    all_reduce: str = "auto"

    def __post_init__(self) -> None:
        kind = self.device.split(":", 1)[0]
        if kind not in ("auto", "cpu", "cuda", "npu"):
            raise ConfigError(f"device must be auto, cpu, cuda or npu, got {self.device!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.all_reduce not in ("auto", "nccl"):
            raise ConfigError(f"all_reduce must be auto or nccl, got {self.all_reduce!r}")
        if self.torch_compile not in TORCH_COMPILE_MODES:
            raise ConfigError(
                f"torch_compile must be one of {', '.join(map(repr, TORCH_COMPILE_MODES))}, "
                f"got {self.torch_compile!r}"
            )
        if self.torch_compile and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"torch_compile={self.torch_compile!r} is not supported with tensor_parallel_size "
                f"{self.tensor_parallel_size} (torch.compile has not been tried on the all-reduces)"
            )


@dataclass(frozen=True)
class ServingConfig:
    """How the Triton stub runs the engine (triton_model/llm_model.py reads it; the core ignores it)."""

    engine_mode: str = "process"  # process: the core in its own process | thread: in the stub's process
    max_merged_steps: int = 16  # a response merges at most this many engine steps when the sender lags
    # Threads that build and send the streams' responses (0: the output thread does it itself).
    # A send is a ~0.2 ms round trip to the server with the GIL released; 8 of them in flight took
    # 64-256 streams from 3.6-4.4 down to 1.8-2.2 tokens per response on an H100 host.
    response_send_threads: int = 8
    # sys.setswitchinterval() in the stub (0: Python's default, 5 ms): how long a thread that wants
    # the GIL waits for the one that holds it. The send threads need it for a moment around each
    # send; at 5 ms they queue behind the busy output thread (measured: worse than no send threads).
    gil_switch_interval_s: float = 0.0002
    # How long the FINAL response of a stub's last request in flight may wait for the histogram
    # observations recorded before it, so that /metrics read right after it counts them
    # (vllm_backend's metrics test reads it then); 0: it never waits. Each observation is a round
    # trip to the server (0.2-0.8 ms on a loaded GPU host), and a wait holds the final back.
    final_histogram_wait_s: float = 0.05
    # At unload / server shutdown, in-flight requests get this long to finish, then they get
    # CANCELLED. Keep it well below tritonserver's --exit-timeout-secs: Triton does not count
    # decoupled requests as in flight and gives up on the model after that timeout.
    shutdown_grace_s: float = 1.0
    # The Python interpreter of the engine core process ("" = the stub's own). The stub must
    # run with numpy < 2 (Triton 2.51's stub reads every tensor wrong under numpy 2); the core does
    # not touch Triton, so it can run in the host's own environment, e.g. a GPU host's torch venv.
    engine_python: str = ""
    # A dead engine core (process mode) is restarted in place, at most engine_max_restarts times
    # within engine_restart_window_s (failed restarts count too); one more and the stub exits
    # non-zero, so that the launcher stops the server (0: never restart).
    engine_max_restarts: int = 3
    engine_restart_window_s: float = 300.0

    def __post_init__(self) -> None:
        if self.engine_mode not in ("process", "thread"):
            raise ConfigError(f"engine_mode must be process or thread, got {self.engine_mode!r}")
        if self.max_merged_steps < 1:
            raise ConfigError(f"max_merged_steps must be >= 1, got {self.max_merged_steps}")
        if not 0 <= self.response_send_threads <= 64:
            raise ConfigError(f"response_send_threads must be in [0, 64], got {self.response_send_threads}")
        if not 0.0 <= self.gil_switch_interval_s <= 1.0:
            raise ConfigError(f"gil_switch_interval_s must be in [0, 1], got {self.gil_switch_interval_s}")
        if not 0.0 <= self.final_histogram_wait_s <= 1.0:
            raise ConfigError(f"final_histogram_wait_s must be in [0, 1], got {self.final_histogram_wait_s}")
        if not 0.0 <= self.shutdown_grace_s <= 600.0:
            raise ConfigError(f"shutdown_grace_s must be in [0, 600], got {self.shutdown_grace_s}")
        if not 0 <= self.engine_max_restarts <= 1000:
            raise ConfigError(f"engine_max_restarts must be in [0, 1000], got {self.engine_max_restarts}")
        if not self.engine_restart_window_s > 0.0:  # also refuses NaN
            raise ConfigError(f"engine_restart_window_s must be > 0, got {self.engine_restart_window_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    serving: ServingConfig = field(default_factory=ServingConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    fault_injection_step: int | None = None  # tests: raise inside the model step once at this step
    # tests: a request with this bad word fails inside AsyncLLM.add_request with an unexpected error
    fault_injection_bad_word: str | None = None

    @staticmethod
    def from_parameters(parameters: Mapping[str, str]) -> EngineConfig:
        """Builds the config from config.pbtxt `parameters` (all values are strings there).

        Names are the section field names, with the aliases in `_ALIASES`; empty values and "0" for
        optional sizes mean "automatic". Unknown names are an error so typos do not go unnoticed.
        """
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for raw_key, raw_value in parameters.items():
            key = _ALIASES.get(raw_key, raw_key)
            value = raw_value.strip() if isinstance(raw_value, str) else raw_value
            if value == "":
                continue
            for section, cls in _SECTIONS.items():
                field_types = {f.name: f.type for f in fields(cls)}
                if key in field_types:
                    sections[section][key] = _coerce(raw_key, value, str(field_types[key]))
                    break
            else:
                if key == "fault_injection_step":
                    top[key] = _coerce(raw_key, value, "int | None")
                elif key == "fault_injection_bad_word":
                    top[key] = value
                elif key == "api_key_sha256":  # Triton serves config.pbtxt to anyone
                    raise ConfigError(
                        "parameter 'api_key_sha256' in config.pbtxt is not read: a digest there is "
                        "readable by anyone; give the keys to `paged-llm serve --api-key` (the model "
                        "then reads a salted verifier from its environment, triton_model/auth.py)"
                    )
                else:
                    raise ConfigError(f"unknown parameter {raw_key!r} in config.pbtxt")
        try:
            return EngineConfig(
                model=ModelConfig(**sections["model"]),
                cache=CacheConfig(**sections["cache"]),
                scheduler=SchedulerConfig(**sections["scheduler"]),
                device=DeviceConfig(**sections["device"]),
                limits=RequestLimits(**sections["limits"]),
                serving=ServingConfig(**sections["serving"]),
                sessions=SessionConfig(**sections["sessions"]),
                speculative=SpeculativeConfig(**sections["speculative"]),
                structured_output=StructuredOutputConfig(**sections["structured_output"]),
                lora=LoRAConfig(**sections["lora"]),
                **top,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from error


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "limits": RequestLimits,
    "serving": ServingConfig,
    "sessions": SessionConfig,
    "speculative": SpeculativeConfig,
    "structured_output": StructuredOutputConfig,
    "lora": LoRAConfig,
}
_ALIASES = {
    "num_kv_blocks": "num_blocks",
    "kv_cache_memory_bytes": "memory_bytes",
    "max_tokens_cap": "max_tokens",
}
# Optional sizes where 0 means "automatic" (None).
_ZERO_IS_AUTO = {
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_tokens_cap",
    "max_prompt_bytes",
    "max_grammar_bytes",
}


def _coerce(name: str, value: str, type_name: str) -> Any:
    try:
        if "bool" in type_name:
            return parse_bool(name, value)
        if "int" in type_name:
            number = parse_int(name, value)
            return None if number == 0 and name in _ZERO_IS_AUTO else number
        if "float" in type_name:
            return parse_float(name, value)
    except ValueError as error:
        raise ConfigError(f"config.pbtxt parameter {error}") from None
    return value
