"""Tensor parallelism (Megatron-style): how a model's weights split over ranks, and the collectives.

Each rank holds a slice of every large matrix:

    QKV, gate/up     column-parallel: rank r computes its heads / its intermediate columns
    o_proj, down     row-parallel:    rank r multiplies its slice of the input, then one all-reduce
    embedding        vocab-parallel:  rank r owns rows [r * V_r, (r + 1) * V_r); an id outside them
                                      reads zeros, and one all-reduce gives every rank the embedding
    LM head          vocab-parallel:  rank r computes logits of its vocabulary rows; an all-gather
                                      puts the full row together (the padding past `vocab_size` is
                                      cut off)

KV heads split like query heads. With fewer KV heads than ranks, each KV head is replicated on
`world_size / num_kv_heads` ranks (rank r keeps KV head r * num_kv_heads // world_size), so each rank
still serves whole groups of query heads:

    8 query heads, 2 KV heads, 4 ranks:   rank 0: q 0-1, kv 0 | rank 1: q 2-3, kv 0
                                          rank 2: q 4-5, kv 1 | rank 3: q 6-7, kv 1

Norm weights and RoPE tables are replicated. With world_size 1 every collective is skipped, so the
single-GPU model runs exactly the ops it ran before.

The all-reduce of a decode step is small (one hidden row per sequence: 8-16 KiB at batch 1) and
its latency is what counts: NCCL took 15 us (2 H100s) to 21 us (4) inside a CUDA graph, twice per
layer. On CUDA, tensors up to ONE_SHOT_MAX_BYTES go through torch's one-shot all-reduce over
symmetric memory instead (9.5-10.5 us measured on the same GPUs): each rank copies its part into a
buffer every rank can read over NVLink (peer-to-peer, no multicast), the ranks meet at a barrier,
and each sums all the buffers itself. Larger tensors (prefill chunks) stay on NCCL.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from paged_llm.config import ConfigError
from paged_llm.device_kind import is_cuda

logger = logging.getLogger(__name__)

# Largest tensor the one-shot all-reduce takes: every rank reads every other rank's copy, so its
# traffic grows with world_size x bytes; decode batches of up to 64 rows of hidden 4096 in bf16.
ONE_SHOT_MAX_BYTES = 512 * 1024
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernel sums


class ModelShape(Protocol):
    """The dimensions that split over ranks. A model's ModelSpec (models/hf_config.py) is one: the
    layers below the models name only what they read."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class ShardPlan:
    """This rank's share of each dimension that splits."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # its first KV head in the checkpoint
    intermediate_size: int  # MLP columns on this rank
    vocab_rows: int  # embedding / LM-head rows per rank (the last rank's may run past vocab_size)

    @staticmethod
    def of(spec: ModelShape, rank: int = 0, world_size: int = 1) -> ShardPlan:
        check_divisible(spec, world_size)
        if spec.num_kv_heads >= world_size:
            num_kv_heads = spec.num_kv_heads // world_size
            kv_head_start = rank * num_kv_heads
        else:  # replicated: world_size / num_kv_heads ranks share each KV head
            num_kv_heads = 1
            kv_head_start = rank * spec.num_kv_heads // world_size
        return ShardPlan(
            rank=rank,
            world_size=world_size,
            num_heads=spec.num_heads // world_size,
            num_kv_heads=num_kv_heads,
            kv_head_start=kv_head_start,
            intermediate_size=spec.intermediate_size // world_size,
            vocab_rows=-(-spec.vocab_size // world_size),
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def rows_of(self, part: str, spec: ModelShape) -> tuple[int, int]:
        """[start, end) of this rank's rows (output features) of a column-parallel checkpoint
        tensor, `part` one of q, kv, intermediate, vocab."""
        head_dim = spec.head_dim
        if part == "q":
            return self.rank * self.num_heads * head_dim, (self.rank + 1) * self.num_heads * head_dim
        if part == "kv":
            return self.kv_head_start * head_dim, (self.kv_head_start + self.num_kv_heads) * head_dim
        if part == "intermediate":
            return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size
        if part == "vocab":
            return self.vocab_start, min(self.vocab_start + self.vocab_rows, spec.vocab_size)
        raise ValueError(part)


def check_divisible(spec: ModelShape, world_size: int) -> None:
    """Startup fails here, naming the numbers, when the model cannot split over `world_size` ranks."""
    if world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    problems = []
    if spec.num_heads % world_size:
        problems.append(f"{spec.num_heads} attention heads")
    if spec.num_kv_heads % world_size and world_size % spec.num_kv_heads:
        problems.append(f"{spec.num_kv_heads} KV heads (neither a multiple nor a divisor)")
    if spec.intermediate_size % world_size:
        problems.append(f"intermediate size {spec.intermediate_size}")
    if problems:
        raise ConfigError(
            f"tensor_parallel_size {world_size} does not divide the model's {', '.join(problems)}"
        )


def all_ranks_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (a collective on the default group)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())


def _all_gather_single(output: torch.Tensor, local: torch.Tensor) -> None:
    """torch.distributed.all_gather_single, named all_gather_into_tensor before torch 2.12."""
    gather = getattr(torch.distributed, "all_gather_single", None)
    (gather or torch.distributed.all_gather_into_tensor)(output, local)


class TensorParallelGroup:
    """The ranks of one model: its collectives, on torch.distributed's default group (NCCL on CUDA,
    gloo on CPU). world_size 1 needs no process group and makes every collective a no-op."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self._one_shot_buffer: torch.Tensor | None = None  # symmetric memory, every rank's
        self._group_name = ""
        self._copy_in_kernel = False  # torch's kernel copies the input into the buffer itself

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def uses_one_shot(self) -> bool:
        return self._one_shot_buffer is not None

    def enable_one_shot(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Sets up the one-shot all-reduce for tensors of `dtype` (a collective: every rank calls it,
        after the process group is up). False where it does not apply (not CUDA, one rank, a dtype
        the kernel does not sum, a torch without it): NCCL does every all-reduce then."""
        if self.world_size == 1 or not is_cuda(device) or dtype not in ONE_SHOT_DTYPES:
            return False
        # Only peer-to-peer loads are used. Without this, torch may also set up NVLink multicast
        # objects for the buffer, which some shared hosts must not have (set for the process: the
        # engine uses no multicast anywhere).
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        buffer = None
        copy_in_kernel = False
        try:
            import torch.distributed._symmetric_memory as symm_mem

            ops = torch.ops.symm_mem
            copy_in_kernel = hasattr(ops, "one_shot_all_reduce_copy_out")
            if copy_in_kernel or hasattr(ops, "one_shot_all_reduce_out"):
                buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        except Exception as error:  # an older torch, no peer access, out of memory
            logger.warning("one-shot all-reduce unavailable (%s): NCCL for every all-reduce", error)
        # Every rank must take the same path in every all-reduce: all use it, or none does.
        if not all_ranks_min(int(buffer is not None), device):
            return False
        group_name = torch.distributed.group.WORLD.group_name
        symm_mem.rendezvous(buffer, group_name)
        self._one_shot_buffer, self._group_name, self._copy_in_kernel = buffer, group_name, copy_in_kernel
        logger.info("tensor parallelism: one-shot all-reduce up to %d KiB", ONE_SHOT_MAX_BYTES // 1024)
        return True

    def release(self) -> None:
        """Drops the symmetric-memory buffer (before the process group goes)."""
        self._one_shot_buffer = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks: in place with NCCL, into a new tensor with the one-shot
        all-reduce; use the returned tensor."""
        if self.world_size == 1:
            return tensor
        buffer = self._one_shot_buffer
        if (
            buffer is not None
            and tensor.dtype == buffer.dtype
            and tensor.numel() <= buffer.numel()
            and tensor.is_contiguous()
        ):
            return self._one_shot_all_reduce(tensor, buffer[: tensor.numel()].view(tensor.shape))
        torch.distributed.all_reduce(tensor)
        return tensor

    def _one_shot_all_reduce(self, tensor: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """One kernel (copy in, barrier, sum every rank's copy, barrier). Its closing barrier is
        what lets the next call reuse the buffer: no rank overwrites it while a peer still reads."""
        out = torch.empty_like(tensor)
        if self._copy_in_kernel:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(shared, tensor, "sum", self._group_name, out)
        else:
            shared.copy_(tensor)
            torch.ops.symm_mem.one_shot_all_reduce_out(shared, "sum", self._group_name, out)
        return out

    def gather_vocab(self, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, V_r] logits of this rank's vocabulary rows -> [T, vocab_size] on every rank."""
        if self.world_size == 1:
            return local_logits
        rows, vocab_rows = local_logits.shape
        gathered = local_logits.new_empty((self.world_size * rows, vocab_rows))  # rank after rank
        _all_gather_single(gathered, local_logits.contiguous())
        by_rank = gathered.view(self.world_size, rows, vocab_rows).permute(1, 0, 2)
        return by_rank.reshape(rows, self.world_size * vocab_rows)[:, :vocab_size]

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int) -> torch.Tensor:
        """Embedding lookup in this rank's rows `weight` ([V_r, H], starting at `vocab_start`)."""
        if self.world_size == 1:
            return F.embedding(input_ids, weight)
        local = input_ids - vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(hidden)
