"""Runs one scheduled step: builds the flat batch (tokens, positions, slots, block tables), runs the
model (a captured CUDA graph for decode-only batches on CUDA), samples the sequences that reached
their last known token, and returns the tokens to the host: the step's one synchronisation.

`launch` only enqueues: the sampled tokens start their copy to (pinned) host memory behind the step,
and `LaunchedStep.result()` waits for that copy alone, so a step launched after this one (asynchronous
scheduling) does not delay it. Such a step reads this one's tokens on the device (`pending_tokens`)."""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from paged_llm.config import ConfigError, LoRAConfig
from paged_llm.core.scheduler import SchedulerOutput
from paged_llm.errors import TensorParallelError
from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.layers.attention.portable import PortableAttention
from paged_llm.layers.fp8_format import E4M3
from paged_llm.layers.fused_ops import FusedOps
from paged_llm.layers.parallel import ShardPlan, TensorParallelGroup, all_ranks_min
from paged_llm.lora.manager import LoRAManager
from paged_llm.models.decoder import AttentionBackend, CausalLM, attach_lora
from paged_llm.models.hf_config import ModelSpec
from paged_llm.models.loader import load_model
from paged_llm.runner.cuda_graphs import (
    MAX_MIXED_GRAPH_SEQS,
    DecodeGraphs,
    MixedStepGraphs,
    mixed_step_token_buckets,
)
from paged_llm.runner.decode_compile import OpaqueToCompiler, compile_decode_forward
from paged_llm.runner.device import Device
from paged_llm.runner.input_buffers import InputBuffers
from paged_llm.runner.memory_profile import profile_free_kv_bytes
from paged_llm.runner.step_types import LaunchedStep
from paged_llm.runner.tensor_parallel import TensorParallelWorkers
from paged_llm.runner.tp_channel import CMD_ALLOCATE, CMD_PROFILE
from paged_llm.sampling.bad_words import banned_token_ids
from paged_llm.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from paged_llm.sampling.token_bitmask import masked_argmax
from paged_llm.sampling.verify import VerifyOutput, verify
from paged_llm.sequence import GrammarTokens, Sequence
from paged_llm.structured_output.grammar import MAX_XGRAMMAR_THREADS, BitmaskTimes, StepBitmask

logger = logging.getLogger(__name__)


def suppressed_token_ids(seq: Sequence, num_output_tokens: int) -> tuple[int, ...]:
    """Tokens that may not be sampled now: EOS and stop ids while below min_tokens, and the tokens
    that would complete one of the request's bad words; `num_output_tokens`: those before the one
    being sampled. A grammar that may end here keeps its EOS
    whatever min_tokens says (it may allow nothing else)."""
    params = seq.sampling_params
    banned = ()
    if params.bad_words_token_ids:
        banned = tuple(banned_token_ids(params.bad_words_token_ids, seq.output_token_ids))
    if num_output_tokens >= params.min_tokens or (seq.grammar is not None and seq.grammar.can_end()):
        return banned
    eos = () if params.ignore_eos else tuple(sorted(seq.eos_token_ids))
    return eos + params.stop_token_ids + banned


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        model_dir: Path,
        device: Device,
        dtype: torch.dtype,
        max_model_len: int,
        block_size_tokens: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_cuda_graphs: bool = True,
        attention: AttentionBackend | None = None,
        enable_triton_gemv: bool = True,
        enable_onednn_linear: bool = True,
        num_speculative_tokens: int = 0,
        greedy_only: bool = False,
        tensor_parallel_size: int = 1,
        parallel: TensorParallelGroup | None = None,
        load_format: str = "safetensors",
        quantization: str = "",
        fp8_kv_cache: bool = False,
        all_reduce: str = "auto",
        torch_compile: str = "",
        grammar_fill_threads: int = 0,
        lora: LoRAConfig | None = None,
    ) -> None:
        """`tensor_parallel_size` > 1: this runner is rank 0 and starts the other ranks' workers
        (runner/tensor_parallel.py) in load(). `parallel`: set by a worker, its rank in the group.
        `all_reduce`: auto (one-shot over symmetric memory for small tensors on CUDA) or nccl.
        `grammar_fill_threads`: xgrammar's threads for a step's bitmask (0: StepBitmask's rule).
        `lora`: the LoRA adapters to serve (read in load())."""
        if lora is not None and lora.allow_runtime_lora_updates and tensor_parallel_size > 1:
            raise ConfigError("allow_runtime_lora_updates is not supported with tensor_parallel_size > 1 yet")
        # What a worker needs to build its own runner (rank_device() moves it to its device).
        self._worker_kwargs = dict(
            spec=spec,
            model_dir=model_dir,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            block_size_tokens=block_size_tokens,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_cuda_graphs=enable_cuda_graphs,
            enable_triton_gemv=enable_triton_gemv,
            enable_onednn_linear=enable_onednn_linear,
            num_speculative_tokens=num_speculative_tokens,
            greedy_only=greedy_only,
            load_format=load_format,
            quantization=quantization,
            fp8_kv_cache=fp8_kv_cache,
            all_reduce=all_reduce,
            torch_compile=torch_compile,
            lora=lora,
        )
        self.load_format = load_format
        self.quantization = quantization
        self.all_reduce = all_reduce
        self.parallel = parallel or TensorParallelGroup(0, tensor_parallel_size)
        self.shard = ShardPlan.of(spec, self.parallel.rank, self.parallel.world_size)
        self.workers: TensorParallelWorkers | None = None
        self.ranks_out_of_step = False  # rank 0 failed inside a step: the workers can only be killed
        self.spec = spec
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size_tokens = block_size_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.attention = attention or default_attention(device)
        # The cache's element type: FP8 entries (key / the layer's k_scale) or the model dtype.
        self.kv_dtype = E4M3 if fp8_kv_cache else dtype
        if fp8_kv_cache and not device.supports_fp8():
            raise ConfigError(
                f"kv_cache_dtype fp8 needs a GPU with FP8 conversions (compute capability 8.9+: Ada, "
                f"Hopper); {device.describe()} has none: use kv_cache_dtype auto"
            )
        self.use_cuda_graphs = enable_cuda_graphs and device.supports_graphs
        self.enable_triton_gemv = enable_triton_gemv
        self.enable_onednn_linear = enable_onednn_linear
        if torch_compile and not self.use_cuda_graphs:
            raise ConfigError(
                f"torch_compile={torch_compile!r} compiles the decode step that a CUDA graph captures: "
                "it needs a CUDA device with enable_cuda_graphs"
            )
        self.torch_compile = torch_compile  # "": our Triton kernels; else Inductor's (decode_compile.py)
        self.num_speculative_tokens = num_speculative_tokens  # proposals a sequence verifies per step
        self.greedy_only = greedy_only  # every row takes its argmax (a draft model's proposals)
        self.sampler = Sampler()
        self.model: CausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.max_blocks_per_seq = -(-max_model_len // block_size_tokens)
        self.buffers = InputBuffers(
            max_num_batched_tokens,
            max_num_seqs,
            self.max_blocks_per_seq,
            block_size_tokens,
            device.torch_device,
            pin_memory=device.pin_memory,
        )
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedStepGraphs | None = None
        # the same graphs captured with the adapter path (LoRA with its kernels): steps with adapter rows
        self.lora_graphs: DecodeGraphs | None = None
        self.lora_mixed_graphs: MixedStepGraphs | None = None
        self.graph_pool_reserve_bytes: int | None = None  # set aside by the memory profile
        self.graph_pool_bytes = 0  # what the captured graphs hold, measured
        self.bitmask: StepBitmask | None = None  # structured output; made for the first constrained step
        self.grammar_fill_threads = grammar_fill_threads
        self.lora_config = lora if lora is not None and lora.enabled else None
        self.lora: LoRAManager | None = None  # made in load()
        self._lora_step = False  # the step being launched has adapter rows (the lora_ graphs, or eager)

    def load(self, show_progress: bool = True) -> None:
        self.device.activate()
        if self.parallel.is_parallel and self.parallel.rank == 0:
            self.workers = TensorParallelWorkers(self._worker_kwargs, self.device, self.parallel.world_size)
        self.model = load_model(
            self.model_dir,
            self.spec,
            OpaqueToCompiler(self.attention) if self.torch_compile else self.attention,
            self.max_model_len,
            self.device.torch_device,
            self.dtype,
            show_progress=show_progress,
            ops=FusedOps(
                use_triton=self.device.supports_triton,
                use_gemv=self.enable_triton_gemv,
                use_onednn=self.enable_onednn_linear and self.device.is_cpu,
            ),
            parallel=self.parallel,
            load_format=self.load_format,
            quantization=self.quantization,
            fp8_kv_cache=self.kv_dtype == E4M3,
        )
        if self.lora_config is not None:
            self.lora = LoRAManager(
                self.lora_config,
                self.spec,
                self.dtype,
                self.device.torch_device,
                self.shard,
                # a decode graph's bucket may pass the token budget (max_num_seqs above it)
                max_num_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
                use_kernels=self.device.supports_triton,
                pin_memory=self.device.pin_memory,
            )
            attach_lora(self.model, self.lora.slots)
        if self.all_reduce == "auto":  # every rank, in the same order: it is a collective
            self.parallel.enable_one_shot(self.device.torch_device, self.dtype)

    def close(self, abort: bool = False) -> None:
        """Stops the tensor-parallel workers (nothing to do without them). `abort`: rank 0 failed
        partway (the ranks may be inside different collectives): kill them instead."""
        if self.bitmask is not None:
            self.bitmask.close()
        if self.workers is not None:
            # A dead worker may have left a collective half done: the device never finishes it.
            abort = abort or self.ranks_out_of_step or bool(self.workers.dead_workers())
            if not abort:
                self.release_graphs()
            self.workers.close(abort=abort)
            self.workers = None

    def watch_workers(self, on_death: Callable[[str], None]) -> None:
        """`on_death(message)` runs on a thread if a tensor-parallel worker exits (no workers: never)."""
        if self.workers is not None:
            self.workers.watch(on_death)

    def check_workers(self) -> None:
        """Raises WorkerDiedError when a tensor-parallel worker has exited."""
        if self.workers is not None:
            self.workers.check_alive()

    def release_graphs(self) -> None:
        """Drops the CUDA graphs. Under tensor parallelism they hold the NCCL communicator's
        resources, and leaving the group before they are gone hung (2 H100s, NCCL 2.28). The
        one-shot all-reduce's buffer goes with them (no step runs after this)."""
        self.graphs = self.lora_graphs = None
        self.mixed_graphs = self.lora_mixed_graphs = None
        self.parallel.release()
        self.device.synchronize()
        gc.collect()
        self.device.empty_cache()

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on this rank (its KV heads; every rank holds as many blocks)."""
        element_bytes = torch.finfo(self.kv_dtype).bits // 8
        elements_per_token = 2 * self.spec.num_layers * self.shard.num_kv_heads * self.spec.head_dim
        return elements_per_token * element_bytes * self.block_size_tokens

    def profile_free_kv_bytes(self, gpu_memory_utilization: float) -> int:
        """This device's KV budget; under tensor parallelism the smallest of all ranks' budgets."""
        if self.workers is not None:
            self.workers.send_command(CMD_PROFILE, round(gpu_memory_utilization * 1e6))
        budget = profile_free_kv_bytes(self, gpu_memory_utilization)
        if self.parallel.is_parallel:
            budget = all_ranks_min(budget, self.device.torch_device)
        return budget

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocates the per-layer KV tensors, then captures the decode graphs that address them."""
        if self.workers is not None:
            self.workers.send_command(CMD_ALLOCATE, num_blocks)
        shape = (num_blocks, self.block_size_tokens, self.shard.num_kv_heads, self.spec.head_dim)
        device = self.device.torch_device
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=device),
                torch.zeros(shape, dtype=self.kv_dtype, device=device),
            )
            for _ in range(self.spec.num_layers)
        ]
        if self.use_cuda_graphs:
            torch.cuda.synchronize(device)
            reserved_before = torch.cuda.memory_reserved(device)
            self.graphs, self.mixed_graphs = self._capture_graphs(None, self.torch_compile)
            if self.lora is not None and self.lora.slots.uses_kernels:
                with self.lora.slots.capturing():  # (no torch.compile: Inductor would trace the kernels)
                    self.lora_graphs, self.lora_mixed_graphs = self._capture_graphs(self.graphs, None)
            torch.cuda.empty_cache()  # the warm-ups' blocks, cached for the capture stream only
            self.graph_pool_bytes = torch.cuda.memory_reserved(device) - reserved_before
            reserve = self.graph_pool_reserve_bytes
            log = logger.warning if reserve is not None and self.graph_pool_bytes > reserve else logger.info
            log(
                "CUDA graphs hold %.0f MiB (%s MiB were set aside for them)",
                self.graph_pool_bytes / 2**20,
                "none" if reserve is None else f"{reserve / 2**20:.0f}",
            )

    def _capture_graphs(
        self, sharing: DecodeGraphs | None, torch_compile: str | None
    ) -> tuple[DecodeGraphs, MixedStepGraphs]:
        """Captures the decode and mixed-step graphs of the model as it runs now, on the memory pool
        of `sharing` (None: a new one)."""
        assert self.model is not None
        device = self.device.torch_device
        graphs = DecodeGraphs(
            self._forward_logits, self.max_num_seqs, self.max_blocks_per_seq, self.max_model_len, device
        )
        graphs.pool = sharing.pool if sharing is not None else None
        if torch_compile:  # compiled once per bucket, at capture
            num_buckets = len(graphs.batch_sizes)
            graphs.forward = compile_decode_forward(self._forward_logits, torch_compile, num_buckets)
        # torch_compile: Inductor traces the PyTorch ops (decode only; the mixed-step graphs below
        # and eager steps keep the Triton kernels).
        with self.model.ops.pytorch_ops() if torch_compile else contextlib.nullcontext():
            graphs.capture()
        mixed_graphs = MixedStepGraphs(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
            self.model.compute_logits,
            mixed_step_token_buckets(self.max_num_batched_tokens),
            self.max_blocks_per_seq,
            self.max_model_len,
            device,
            pool=graphs.pool,
            max_num_seqs=min(self.max_num_seqs, MAX_MIXED_GRAPH_SEQS),
            rows_per_seq=1 + self.num_speculative_tokens,
        )
        mixed_graphs.capture()
        return graphs, mixed_graphs

    def _forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert self.model is not None
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, metadata))

    # --------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueues the step's model forward and sampling on the device and returns at once (on an
        accelerator); `result()` waits for the sampled tokens. `previous`: the step launched before
        this one whose result() has not been taken yet (its tokens are this step's pending inputs).

        A constrained row's mask needs its grammar to have taken the previous token, which is still
        on the device when `previous` is given: then only the forward is enqueued (the step
        `needs_sampling`), and `sample_deferred` samples once the previous step's tokens are in."""
        step = self._launch(scheduler_output, previous)
        if step.needs_sampling:
            return step
        self._copy_to_host(step)
        return step

    def start_deferred_sampling(
        self, step: LaunchedStep, grammar_tokens: GrammarTokens | None = None
    ) -> None:
        """A step launched with `needs_sampling` whose previous step's tokens are on the host:
        starts filling its bitmask on the fill thread, after the grammars took `grammar_tokens`
        (those tokens, if the engine's thread left them to it: StepBitmask.start; a row or two it
        does now). Until `sample_deferred` ran, nothing may advance or read these sequences'
        grammars, nor those in `grammar_tokens`."""
        assert step.needs_sampling and step.pending_bitmask is None, "one start a launched step"
        step.pending_bitmask = self._step_bitmask().start(step.seqs, grammar_tokens)

    @torch.inference_mode()
    def sample_deferred(self, step: LaunchedStep) -> None:
        """Samples a step launched with `needs_sampling` (its grammars are up to date now), with
        the bitmask `start_deferred_sampling` began, if it did."""
        assert step.needs_sampling and step.unsampled_logits is not None
        pending, step.pending_bitmask = step.pending_bitmask, None
        token_bitmask = self._step_bitmask().finish(pending) if pending is not None else None
        step.sampled = self._sample(
            step.unsampled_logits, step.seqs, deferred=True, token_bitmask=token_bitmask
        )
        step.unsampled_logits = None
        step.needs_sampling = False
        self._copy_to_host(step)

    def bitmask_times(self) -> BitmaskTimes | None:
        """The grammar bitmask's fill totals (None before the first constrained step)."""
        return None if self.bitmask is None else copy.copy(self.bitmask.times)

    def _step_bitmask(self) -> StepBitmask:
        if self.bitmask is None:
            self.bitmask = StepBitmask(
                self.max_num_seqs,
                self.spec.vocab_size,
                self.device.torch_device,
                self.device.pin_memory,
                max_threads=self.grammar_fill_threads or MAX_XGRAMMAR_THREADS,
            )
        return self.bitmask

    def _copy_to_host(self, step: LaunchedStep) -> None:
        """Starts the copy of the step's tokens to the host, behind the step on the device."""
        if not self.device.is_accelerator or (step.sampled is None and step.verified is None):
            return
        if step.sampled is not None:
            step.host = SamplerOutput(
                *(
                    None if tensor is None else tensor.to("cpu", non_blocking=True)
                    for tensor in (getattr(step.sampled, f.name) for f in fields(SamplerOutput))
                )
            )
        if step.verified is not None:
            step.verified_host = VerifyOutput(
                step.verified.token_ids.to("cpu", non_blocking=True),
                step.verified.num_emitted.to("cpu", non_blocking=True),
            )
        step.copied = self.device.new_event()
        step.copied.record()

    def _launch(self, scheduler_output: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        assert self.model is not None, "load() first"
        pending = previous.pending_tokens() if previous is not None else None
        # The host half of the inputs first: with `previous`'s sampling deferred, its grammar
        # masks are still being filled on the fill thread meanwhile.
        inputs = self.buffers.prepare(scheduler_output, pending)
        if previous is not None:
            if previous.needs_sampling:
                self.sample_deferred(previous)  # this step's inputs are its tokens
            self.buffers.fill_pending(inputs, previous.sampled_token_ids())
        model_inputs = (inputs.input_ids, inputs.positions, inputs.metadata, inputs.sample_indices)
        if self.workers is None:
            if self.lora is not None:
                self._lora_step = self.lora.prepare_step(scheduler_output.scheduled)
            logits = self.forward_step(*model_inputs)
        else:
            self.workers.check_alive()
            try:  # a header some workers got and others not leaves them out of step as well
                if self.lora is not None:  # (slots rank 0 loaded and the workers not: out of step)
                    self._prepare_lora_step_for_all_ranks(scheduler_output)
                self.workers.send_step(inputs)
                logits = self.forward_step(*model_inputs)
            except Exception as error:  # the workers wait in a collective rank 0 never reaches
                self.ranks_out_of_step = True
                self.workers.check_alive()
                raise TensorParallelError(
                    f"rank 0 failed inside a step ({type(error).__name__}: {error}); the tensor-parallel "
                    "ranks are out of step: the engine stops"
                ) from error
        if logits is None:
            return LaunchedStep([], None)
        seqs = inputs.sampled_seqs
        verify_rows = inputs.verify_rows
        if verify_rows is not None and seqs:
            assert inputs.sampled_rows is not None
            sampled_logits = logits.index_select(0, inputs.sampled_rows)
        else:
            sampled_logits = logits if seqs else None
        step = LaunchedStep(seqs, None)
        if sampled_logits is not None:
            if previous is not None and not self.greedy_only and any(seq.grammar is not None for seq in seqs):
                step.needs_sampling, step.unsampled_logits = True, sampled_logits
            else:
                step.sampled = self._sample(sampled_logits, seqs)
        if verify_rows is not None:
            step.verify_seqs = verify_rows.seqs
            step.verified = verify(logits, verify_rows, self.spec.vocab_size)
        return step

    def _prepare_lora_step_for_all_ranks(self, scheduler_output: SchedulerOutput) -> None:
        """Rank 0's prepare_step, and the rows and loads to the workers when they matter: a step with
        adapter rows or slot loads, or the first base-only step after one (their flag goes off)."""
        assert self.lora is not None and self.workers is not None
        was_active = self._lora_step
        self._lora_step = self.lora.prepare_step(scheduler_output.scheduled)
        if self._lora_step or was_active or self.lora.step_loads:
            self.workers.send_lora_step(self.lora.step_rows, self.lora.step_loads)

    def set_lora_step(self, active: bool) -> None:
        """A tensor-parallel worker's step has adapter rows (rank 0 decided: LoRAManager.replay_step)."""
        self._lora_step = active

    def forward_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        sample_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """The model over the step's tokens; the logits of rows `sample_indices` (None when there
        are none: only prefill chunks short of their end). The path (decode graph, mixed-step graph,
        eager) depends only on these inputs, so every tensor-parallel rank takes the same one."""
        assert self.model is not None
        num_sampled = sample_indices.shape[0]
        if num_sampled == 0:
            self.model(input_ids, positions, self.kv_caches, metadata)
            return None
        if self._lora_step:  # captured with the adapter path, or None (eager)
            graphs, mixed_graphs = self.lora_graphs, self.lora_mixed_graphs
        else:
            graphs, mixed_graphs = self.graphs, self.mixed_graphs
        if graphs is not None and metadata.is_decode_only and graphs.bucket(metadata.num_seqs):
            logits = graphs.run(input_ids, positions, metadata)
            if num_sampled != metadata.num_seqs:  # a 1-token prefill chunk among decodes
                logits = logits.index_select(0, sample_indices)
            return logits
        if (
            mixed_graphs is not None
            and mixed_graphs.bucket(metadata.num_tokens, metadata.num_seqs, num_sampled) is not None
        ):  # a small step with prefill chunks: the first token of new requests at low load
            return mixed_graphs.run(input_ids, positions, metadata, sample_indices)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden.index_select(0, sample_indices))

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        deferred: bool = False,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """`deferred`: the step's own pending token is already appended to each sequence (its
        on_launched ran): a row samples output position len - 1, as it would have at launch.
        `token_bitmask`: the rows' grammar bitmask, filled already (else filled here if needed)."""
        num_ahead = int(deferred)
        if token_bitmask is None and not self.greedy_only and any(seq.grammar is not None for seq in seqs):
            token_bitmask = self._step_bitmask().fill(seqs)
        if self.greedy_only or all(
            r.sampling_params.is_greedy_under_grammar
            and r.num_output_tokens - num_ahead >= r.sampling_params.min_tokens
            for r in seqs
        ):
            # The common benchmark/greedy case, constrained or not: skip building per-row sampling
            # metadata (~6 us a row of host time on a constrained c64 step), which would only mask
            # and take the argmax. Past min_tokens no row has a token to suppress.
            if token_bitmask is None:
                return SamplerOutput(logits.argmax(dim=-1), None, None, None, None)
            return SamplerOutput(masked_argmax(logits, token_bitmask), None, None, None, None)
        rows = [
            SamplingRow(
                params=seq.sampling_params,
                seed=seq.seed,
                prompt_token_ids=seq.prompt_token_ids,
                # Deferred steps were launched ahead, which no row reading its output's values
                # (penalties, bad words) allows: only the length (the noise position) is read.
                output_token_ids=range(seq.num_output_tokens - 1) if deferred else seq.output_token_ids,
                suppressed_token_ids=suppressed_token_ids(seq, seq.num_output_tokens - num_ahead),
            )
            for seq in seqs
        ]
        metadata = SamplingMetadata.build(rows, self.spec.vocab_size, logits.device, token_bitmask)
        return self.sampler(logits, metadata)


def default_attention(device: Device) -> AttentionBackend:
    """Triton kernels on CUDA; the portable PyTorch path on CPU and NPU."""
    if device.supports_triton:
        from paged_llm.layers.attention.triton_backend import DEFAULT_NUM_SMS, TritonAttention

        return TritonAttention(num_sms=device.num_multiprocessors() or DEFAULT_NUM_SMS)
    return PortableAttention()
