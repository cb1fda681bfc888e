"""The adapters of a step, on the device: `max_loras` slots of stacked LoRA weights per decoder
layer and fused projection, and each step's rows grouped by slot.

A fused projection holds its sub-modules' updates side by side: for qkv_proj, a slot's `a` is
[3 * R, in] (q's A, then k's, then v's, each padded with zero rows to R = max_lora_rank) and its
`b` [q + 2 kv, 3 * R], block-diagonal (q's rows read only q's R columns), so one product of the
slot's rows gives all three updates. PEFT's scaling is folded into `b` at load, as vLLM does.
Modules an adapter leaves alone, and ranks below R, stay zero.

Under tensor parallelism a slot holds this rank's share: the rows of `b` of the column-parallel
projections (qkv, gate/up) and the columns of `a` of the row-parallel ones (o, down), whose
partial updates the layer's all-reduce adds up with the base output's.

The per-step path (`add`): on CUDA the Triton kernels of lora/kernels.py, every adapter of the step
in one shrink and one expand launch, reading the step's tiles from a device buffer (lora/step_tiles.py),
so steps with adapter rows replay CUDA graphs captured with them (`capturing`). Elsewhere PyTorch:
one pair of matmuls per adapter in the step, over its rows (a slice where they are contiguous).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paged_llm.layers.parallel import ShardPlan
from paged_llm.lora.adapter import LoRAAdapter
from paged_llm.models.hf_config import ModelSpec

# fused projection -> (its sub-modules, the ShardPlan part of its output rows, of its input columns)
FUSED_PROJECTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None, str | None]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), ("q", "kv", "kv"), None),
    "o_proj": (("o_proj",), None, "q"),
    "gate_up_proj": (("gate_proj", "up_proj"), ("intermediate", "intermediate"), None),
    "down_proj": (("down_proj",), None, "intermediate"),
}

NO_ADAPTER = -1  # a row of the base model


if TYPE_CHECKING:
    from paged_llm.lora.step_tiles import StepTiles


@dataclass(frozen=True)
class SlotRows:
    """One slot's rows in a step: `rows` a slice when contiguous, else an index tensor."""

    slot: int
    rows: slice | torch.Tensor


class LoRASlots:
    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        shard: ShardPlan | None = None,
        max_num_tokens: int | None = None,
        use_kernels: bool = False,
        pin_memory: bool = False,
    ) -> None:
        """`use_kernels`: the Triton kernels (CUDA), for steps of at most `max_num_tokens` tokens."""
        self.spec = spec
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.shard = shard or ShardPlan.of(spec)
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for name, (subs, _, _) in FUSED_PROJECTIONS.items():
            in_features, out_features = self._local_shape(name)
            width = len(subs) * max_rank
            self.a[name] = [
                torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
                for _ in range(spec.num_layers)
            ]
            self.b[name] = [
                torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)
                for _ in range(spec.num_layers)
            ]
        self.adapter_in_slot: list[str | None] = [None] * num_slots
        self._step: list[SlotRows] = []  # this step's adapter rows, by slot (PyTorch path)
        self.tiles: StepTiles | None = None  # this step's adapter rows, for the kernels
        self._partial = torch.empty(0)
        if use_kernels:
            from paged_llm.lora.kernels import partial_rows_needed
            from paged_llm.lora.step_tiles import StepTiles

            assert max_num_tokens is not None
            self.tiles = StepTiles(max_num_tokens, num_slots, device, pin_memory)
            widest = max(len(subs) for subs, _, _ in FUSED_PROJECTIONS.values()) * max_rank
            rows = partial_rows_needed(max_num_tokens, num_slots)
            self._partial = torch.empty(rows * widest, dtype=torch.float32, device=device)
        self._kernel_step = False  # the kernels' step has adapter rows
        self._capturing = False

    @property
    def uses_kernels(self) -> bool:
        return self.tiles is not None

    @property
    def active(self) -> bool:
        """The step being run (or the graph being captured) goes through the adapter path."""
        return bool(self._step) or self._kernel_step or self._capturing

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The model traced with the adapter path for CUDA graphs, with no adapter rows (the graphs'
        warm-up runs change nothing); replays then add what the step's tiles say."""
        assert self.tiles is not None
        self.clear_step()
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def _sub_sizes(self, name: str) -> list[int]:
        _, row_parts, _ = FUSED_PROJECTIONS[name]
        if row_parts is None:
            return [self._local_shape(name)[1]]
        return [end - start for start, end in (self.shard.rows_of(p, self.spec) for p in row_parts)]

    def _local_shape(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of this rank's share of the fused projection."""
        spec, shard = self.spec, self.shard
        q_size = shard.num_heads * spec.head_dim
        kv_size = shard.num_kv_heads * spec.head_dim
        return {
            "qkv_proj": (spec.hidden_size, q_size + 2 * kv_size),
            "o_proj": (q_size, spec.hidden_size),
            "gate_up_proj": (spec.hidden_size, 2 * shard.intermediate_size),
            "down_proj": (shard.intermediate_size, spec.hidden_size),
        }[name]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Writes `adapter` into `slot` (zeros where it has no module); it must fit max_rank."""
        assert adapter.max_rank <= self.max_rank, (adapter.name, adapter.max_rank, self.max_rank)
        rank_width = self.max_rank
        for name, (subs, row_parts, column_part) in FUSED_PROJECTIONS.items():
            sub_sizes = self._sub_sizes(name)
            for layer in range(self.spec.num_layers):
                a = torch.zeros_like(self.a[name][layer][slot], device="cpu", dtype=torch.float32)
                b = torch.zeros_like(self.b[name][layer][slot], device="cpu", dtype=torch.float32)
                row = 0
                for index, sub in enumerate(subs):
                    module = adapter.modules.get((layer, sub))
                    size = sub_sizes[index]
                    if module is not None:
                        rank = module.rank
                        columns = slice(index * rank_width, index * rank_width + rank)
                        sub_a, sub_b = module.a, module.b * module.scaling
                        if row_parts is not None:
                            start, end = self.shard.rows_of(row_parts[index], self.spec)
                            sub_b = sub_b[start:end]
                        if column_part is not None:
                            start, end = self.shard.rows_of(column_part, self.spec)
                            sub_a = sub_a[:, start:end]
                        a[columns] = sub_a
                        b[row : row + size, columns] = sub_b
                    row += size
                self.a[name][layer][slot].copy_(a)
                self.b[name][layer][slot].copy_(b)
        self.adapter_in_slot[slot] = adapter.name

    def set_step(self, token_slots: list[tuple[int, int]]) -> None:
        """The step's rows: (slot or NO_ADAPTER, number of tokens) per scheduled sequence, in the
        flat batch's order."""
        if self.tiles is not None:
            self.tiles.set(token_slots)
            self._kernel_step = any(slot != NO_ADAPTER for slot, _ in token_slots)
            return
        rows_of: dict[int, list[tuple[int, int]]] = {}
        cursor = 0
        for slot, num_tokens in token_slots:
            if slot != NO_ADAPTER:
                ranges = rows_of.setdefault(slot, [])
                if ranges and ranges[-1][1] == cursor:
                    ranges[-1] = (ranges[-1][0], cursor + num_tokens)
                else:
                    ranges.append((cursor, cursor + num_tokens))
            cursor += num_tokens
        step = []
        for slot, ranges in rows_of.items():
            if len(ranges) == 1:
                step.append(SlotRows(slot, slice(*ranges[0])))
            else:
                index = torch.cat([torch.arange(start, end) for start, end in ranges])
                step.append(SlotRows(slot, index.to(self.device, non_blocking=True)))
        self._step = step

    def clear_step(self) -> None:
        self._step = []
        if self.tiles is not None and self._kernel_step:
            self.tiles.clear()
        self._kernel_step = False

    def add(self, projection: str, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`, [T, out]) plus each adapter row's update, in place."""
        a_slots, b_slots = self.a[projection][layer], self.b[projection][layer]
        if self.tiles is not None:
            from paged_llm.lora.kernels import LaunchShape, lora_update

            shape = LaunchShape.of(x.shape[0], self.num_slots)
            return lora_update(x, out, a_slots, b_slots, self.tiles.tensors, self._partial, shape)
        for item in self._step:
            a, b = a_slots[item.slot], b_slots[item.slot]
            if isinstance(item.rows, slice):
                out[item.rows] += (x[item.rows] @ a.T) @ b.T
            else:
                out.index_add_(0, item.rows, (x.index_select(0, item.rows) @ a.T) @ b.T)
        return out


class LayerLoRA:
    """One decoder layer's view of the slots (what its Attention and MLP call)."""

    __slots__ = ("layer", "slots")

    def __init__(self, slots: LoRASlots, layer: int) -> None:
        self.slots = slots
        self.layer = layer

    @property
    def active(self) -> bool:
        return self.slots.active

    def add(self, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.slots.add(projection, self.layer, x, out)
