"""Runs one scheduled step: builds the flat batch (tokens, positions, slots, block tables), runs the
model, samples the sequences that reached their last known token, and returns tokens to the host."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from paged_llm.core.scheduler import SchedulerOutput
from paged_llm.models.decoder import AttentionBackend, CausalLM
from paged_llm.models.hf_config import ModelSpec
from paged_llm.models.loader import load_model
from paged_llm.request import Request
from paged_llm.runner.attention.metadata import AttentionMetadata
from paged_llm.runner.attention.portable import PortableAttention
from paged_llm.runner.device import Device
from paged_llm.sampling.sampler import Sampler, SamplingMetadata, SamplingRow

logger = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    sampled_logprob: float  # raw model logprob of the sampled token
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]  # `logprobs` alternatives, most likely first
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # only requests that asked


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the hidden states that produce logits
    sampled_requests: list[Request]  # the S requests sampling this step, in row order


def suppressed_token_ids(request: Request) -> tuple[int, ...]:
    """Tokens that may not be sampled yet: EOS and stop ids while below min_tokens."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else tuple(sorted(request.eos_token_ids))
    return eos + params.stop_token_ids


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        model_dir: Path,
        device: Device,
        dtype: torch.dtype,
        max_model_len: int,
        block_size_tokens: int,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.spec = spec
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size_tokens = block_size_tokens
        self.attention = attention or PortableAttention()
        self.sampler = Sampler()
        self.model: CausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def load(self, show_progress: bool = True) -> None:
        self.device.activate()
        self.model = load_model(
            self.model_dir,
            self.spec,
            self.attention,
            self.max_model_len,
            self.device.torch_device,
            self.dtype,
            show_progress=show_progress,
        )

    @property
    def kv_bytes_per_block(self) -> int:
        element_bytes = torch.finfo(self.dtype).bits // 8
        return self.spec.kv_bytes_per_token_per_element * element_bytes * self.block_size_tokens

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size_tokens, self.spec.num_kv_heads, self.spec.head_dim)
        device = self.device.torch_device
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.spec.num_layers)
        ]

    # --------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model is not None, "load() first"
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        if not inputs.sampled_requests:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        return self.sample(logits, inputs.sampled_requests)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
        rows = [
            SamplingRow(
                params=request.sampling_params,
                seed=request.seed,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                suppressed_token_ids=suppressed_token_ids(request),
            )
            for request in requests
        ]
        metadata = SamplingMetadata.build(rows, self.spec.vocab_size, logits.device)
        sampled = self.sampler(logits, metadata)
        # The one host synchronisation of the step: the sampled tokens (and logprobs if asked).
        token_ids = sampled.sampled_token_ids.tolist()
        output = ModelRunnerOutput({r.request_id: t for r, t in zip(requests, token_ids)})
        if sampled.sampled_logprobs is not None:
            logprobs = sampled.sampled_logprobs.tolist()
            ranks = (
                sampled.sampled_ranks.tolist() if sampled.sampled_ranks is not None else [0] * len(requests)
            )
            top_ids = sampled.topk_token_ids.tolist() if sampled.topk_token_ids is not None else None
            top_values = sampled.topk_logprobs.tolist() if sampled.topk_logprobs is not None else None
            for row, request in enumerate(requests):
                num_top = request.sampling_params.logprobs
                if num_top is None:
                    continue
                output.logprobs[request.request_id] = TokenLogprobs(
                    sampled_logprob=float(logprobs[row]),
                    sampled_rank=int(ranks[row]),
                    top_token_ids=top_ids[row][:num_top] if top_ids else [],
                    top_logprobs=top_values[row][:num_top] if top_values else [],
                )
        return output

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        block_size = self.block_size_tokens
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled_requests: list[Request] = []
        scheduled = scheduler_output.scheduled
        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for row, item in enumerate(scheduled):
            start, num_new = item.num_computed_tokens, item.num_new_tokens
            token_ids.extend(item.request.all_token_ids[start : start + num_new])
            pos = np.arange(start, start + num_new, dtype=np.int64)
            table = np.asarray(item.block_ids, dtype=np.int64)
            block_tables[row, : len(table)] = table
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            if item.needs_sample:
                sample_rows.append(sum(query_lens) - 1)
                sampled_requests.append(item.request)
        device = self.device.torch_device
        query_start = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])

        def to_device(array: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.as_tensor(np.asarray(array), dtype=dtype)
            if self.device.pin_memory:
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor

        metadata = AttentionMetadata(
            num_tokens=len(token_ids),
            slot_mapping=to_device(np.concatenate(slots), torch.int64),
            query_start_loc=to_device(query_start, torch.int32),
            seq_lens=to_device(np.asarray(seq_lens, dtype=np.int32), torch.int32),
            block_tables=to_device(block_tables, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        return StepInputs(
            input_ids=to_device(np.asarray(token_ids, dtype=np.int64), torch.int64),
            positions=to_device(np.concatenate(positions), torch.int64),
            metadata=metadata,
            sample_indices=to_device(np.asarray(sample_rows, dtype=np.int64), torch.int64),
            sampled_requests=sampled_requests,
        )
