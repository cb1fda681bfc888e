"""The engine core's start-up: resolve the checkpoint and device, load the model (and a draft
model, and the tensor-parallel workers), size the KV pool, allocate it and capture the CUDA graphs.
Anything that fails after workers started stops them before the error propagates."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from paged_llm.config import EngineConfig
from paged_llm.engine.core_types import EngineCoreInfo
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.models.hf_config import ModelSpec, load_model_spec
from paged_llm.runner.device import Device
from paged_llm.runner.kv_sizing import plan_kv_cache
from paged_llm.runner.model_runner import ModelRunner
from paged_llm.runner.tensor_parallel import check_tensor_parallel
from paged_llm.spec_decode.draft_model import load_draft_runner

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    spec: ModelSpec
    device: Device
    runner: ModelRunner  # weights loaded, KV pool allocated, graphs captured
    draft_runner: ModelRunner | None  # the draft model of speculative decoding, likewise
    info: EngineCoreInfo  # what stubs learn about the engine (max_model_len as the pool allows)
    prefix_cache_salt: bytes  # block hashes differ per checkpoint and dtype


def load_engine_model(config: EngineConfig, show_progress: bool) -> LoadedModel:
    model_dir = resolve_model_dir(config.model.model)
    spec = load_model_spec(model_dir)
    device = Device.resolve(config.device.device)
    dtype = device.model_dtype(config.model.dtype, spec.checkpoint_dtype)
    requested_len = config.model.max_model_len or spec.max_position_embeddings
    block_size = config.cache.block_size_tokens
    check_tensor_parallel(config, spec, device)
    runner = ModelRunner(
        spec,
        model_dir,
        device,
        dtype,
        requested_len,
        block_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        enable_cuda_graphs=config.device.enable_cuda_graphs,
        enable_triton_gemv=config.device.enable_triton_gemv,
        enable_onednn_linear=config.device.enable_onednn_linear,
        num_speculative_tokens=config.speculative.num_speculative_tokens,
        tensor_parallel_size=config.device.tensor_parallel_size,
        load_format=config.model.load_format,
        quantization=config.model.quantization,
        fp8_kv_cache=config.cache.is_fp8,
        all_reduce=config.device.all_reduce,
        torch_compile=config.device.torch_compile,
        grammar_fill_threads=config.structured_output.grammar_fill_threads,
        lora=config.lora,
    )
    try:
        runner.load(show_progress=show_progress)
        draft_runner = None
        if config.speculative.enabled and config.speculative.speculative_method == "draft_model":
            draft_runner = load_draft_runner(config, spec, device, dtype, requested_len, show_progress)
        plan = plan_kv_cache(config, runner, device, draft_runner)
        runner.allocate_kv_cache(plan.num_blocks)
        if draft_runner is not None:
            draft_runner.allocate_kv_cache(plan.num_blocks)
    except BaseException:
        runner.close(abort=True)  # no tensor-parallel worker outlives a failed start
        raise
    max_model_len = min(requested_len, plan.num_blocks * block_size)
    if max_model_len < requested_len:
        logger.warning(
            "KV pool holds %d tokens, less than max_model_len %d: max_model_len lowered to %d",
            plan.num_blocks * block_size,
            requested_len,
            max_model_len,
        )
    info = EngineCoreInfo(
        model_dir=str(model_dir),
        architecture=spec.architecture,
        vocab_size=spec.vocab_size,
        max_model_len=max_model_len,
        num_kv_blocks=plan.num_blocks,
        block_size_tokens=block_size,
        eos_token_ids=frozenset(spec.eos_token_ids),
        device=device.describe(),
        dtype=str(dtype).removeprefix("torch."),
        lora_names=runner.lora.names if runner.lora is not None else (),
        lora_runtime_updates=config.lora.allow_runtime_lora_updates,
    )
    _log_start(info, runner, Path(model_dir))
    salt = hashlib.sha256((Path(model_dir) / "config.json").read_bytes() + str(dtype).encode()).digest()
    return LoadedModel(spec, device, runner, draft_runner, info, salt)


def _log_start(info: EngineCoreInfo, runner: ModelRunner, model_dir: Path) -> None:
    parallel = runner.parallel.world_size
    logger.info(
        "paged_llm engine core: %s (%s) on %s%s, dtype %s; KV pool %d blocks x %d tokens = %d tokens "
        "(%.1f MiB per device); max_model_len %d",
        model_dir,
        info.architecture,
        info.device,
        f" and {parallel - 1} more (tensor parallel)" if parallel > 1 else "",
        info.dtype,
        info.num_kv_blocks,
        info.block_size_tokens,
        info.num_kv_blocks * info.block_size_tokens,
        info.num_kv_blocks * runner.kv_bytes_per_block / (1 << 20),
        info.max_model_len,
    )
