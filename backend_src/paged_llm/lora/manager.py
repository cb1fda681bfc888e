"""The runner's adapters: every configured one read and checked at start-up, at most max_cpu_loras
kept in host memory (least recently used dropped, read again when a step needs it), and each step's
adapters put in device slots (least recently used slot first) before its forward."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Protocol

import torch

from paged_llm.config import LoRAConfig
from paged_llm.layers.parallel import ShardPlan
from paged_llm.lora.adapter import LoRAAdapter, load_adapter
from paged_llm.lora.slots import NO_ADAPTER, LoRASlots
from paged_llm.models.hf_config import ModelSpec
from paged_llm.sequence import Sequence

logger = logging.getLogger(__name__)


class ScheduledRows(Protocol):
    seq: Sequence
    num_new_tokens: int


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        shard: ShardPlan | None = None,
        max_num_tokens: int | None = None,
        use_kernels: bool = False,
        pin_memory: bool = False,
    ) -> None:
        """`use_kernels`: the slots' Triton kernels (CUDA) for steps up to `max_num_tokens` tokens."""
        self.spec = spec
        self.max_lora_rank = config.max_lora_rank
        self.paths = {name: Path(path) for name, path in config.modules().items()}
        num_slots = min(config.max_loras, max(1, len(self.paths)))
        if config.allow_runtime_lora_updates:  # room for whatever is loaded later
            num_slots = config.max_loras
        # None: every adapter stays in host memory; else at least a step's worth of them (a step's
        # adapters are all in host memory while it loads them)
        self.max_cpu_loras = max(config.max_cpu_loras, num_slots) if config.max_cpu_loras else None
        # in host memory, least recently used first
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        ranks = []
        for name in self.paths:
            adapter = self._read(name)
            ranks.append(adapter.max_rank)
            logger.info(
                "LoRA adapter %r: rank %d, %d modules (%s)",
                adapter.name,
                adapter.max_rank,
                len(adapter.modules),
                adapter.path,
            )
        max_rank = config.max_lora_rank if config.allow_runtime_lora_updates else max(ranks, default=1)
        self.slots = LoRASlots(
            spec, num_slots, max_rank, dtype, device, shard, max_num_tokens, use_kernels, pin_memory
        )
        self._slot_of: dict[str, int] = {}
        self._last_used = [-1] * num_slots  # the step that last used each slot
        self._num_steps = 0
        self.num_loads = 0  # adapters written into a slot
        self.step_rows: list[tuple[int, int]] = []  # the last prepare_step's (slot, tokens) per sequence
        self.step_loads: list[tuple[int, int]] = []  # and its loads: (slot, adapter index)
        # every adapter ever loaded, by the index the tensor-parallel messages name it by
        self._names = list(self.paths)
        self._index_of = {name: index for index, name in enumerate(self._names)}
        self.num_reads = len(self.paths)  # adapters read from disk (each once at start-up)
        self.num_evictions = 0  # of those, ones that replaced another adapter

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def load_id(self, name: str) -> int:
        """Which load of the adapters this one is (each load, a reload under a known name too, gets
        a new one): the prefix cache keys its blocks by it (sequence.py prefix_hash_root)."""
        return self._index_of[name]

    @property
    def num_slots_used(self) -> int:
        return len(self._slot_of)

    def add(self, name: str, path: Path) -> None:
        """Reads and checks an adapter loaded while serving (LoRAAdapterError: not added)."""
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is loaded already")
        adapter = load_adapter(name, path, self.spec, self.max_lora_rank)  # (rank <= the slots')
        self.paths[name] = Path(path)
        self._index_of[name] = len(self._names)
        self._names.append(name)
        self.adapters[name] = adapter
        self._keep_max_cpu_loras()
        self.num_reads += 1

    def remove(self, name: str) -> None:
        """Forgets an adapter no sequence uses any more (its slot becomes free)."""
        del self.paths[name]
        self.adapters.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.slots.adapter_in_slot[slot] = None
            self._last_used[slot] = -1

    def prepare_step(self, scheduled: Seq[ScheduledRows]) -> bool:
        """Puts the step's adapters in slots and tells the slots the step's rows; True when any row
        runs with an adapter (the step then takes the adapter path). `step_rows` and `step_loads` say what
        it did, for the tensor-parallel ranks (replay_step)."""
        self._num_steps += 1
        self.step_loads = []
        names = [item.seq.sampling_params.lora_name for item in scheduled]
        # Every adapter this step loads is read first: a read that fails (a file gone since
        # start-up) then fails the step before any slot changed.
        missing = {name for name in names if name is not None and name not in self._slot_of}
        adapters = {name: self._adapter(name) for name in missing}
        for name in set(names) - missing - {None}:  # in a slot already: not one to reuse this step
            self._last_used[self._slot_of[name]] = self._num_steps
        rows = [
            (NO_ADAPTER if name is None else self._slot(name, adapters), item.num_new_tokens)
            for name, item in zip(names, scheduled, strict=True)
        ]
        self.step_rows = rows
        return self._set_step(rows)

    def use_slot_for_profiling(self, num_tokens: int) -> None:
        """The memory profile's step: every row through slot 0 (the adapter path's temporaries)."""
        self.slots.set_step([(0, num_tokens)])

    def end_profiling(self) -> None:
        self.slots.clear_step()

    def replay_step(self, rows: list[tuple[int, int]], loads: list[tuple[int, int]]) -> bool:
        """Another rank's prepare_step: (slot, adapter index in lora_modules) loads, then the rows."""
        for slot, index in loads:
            self.slots.load(slot, self._adapter(self._names[index]))
        return self._set_step(rows)

    def _set_step(self, rows: list[tuple[int, int]]) -> bool:
        if any(slot != NO_ADAPTER for slot, _ in rows):
            self.slots.set_step(rows)
            return True
        self.slots.clear_step()
        return False

    def _slot(self, name: str, adapters: dict[str, LoRAAdapter]) -> int:
        slot = self._slot_of.get(name)
        if slot is None:
            # the least recently used slot; one this step already uses cannot be its (the
            # scheduler keeps a batch within the slots' number of adapters)
            slot = min(range(self.slots.num_slots), key=self._last_used.__getitem__)
            if self._last_used[slot] == self._num_steps:
                raise RuntimeError(f"LoRA: more adapters in one step than the {self.slots.num_slots} slots")
            evicted = self.slots.adapter_in_slot[slot]
            if evicted is not None:
                self._slot_of.pop(evicted, None)
                self.num_evictions += 1
            self.slots.adapter_in_slot[slot] = None  # until the load below has finished
            self.slots.load(slot, adapters[name])
            self.num_loads += 1
            self.step_loads.append((slot, self._index_of[name]))
            self._slot_of[name] = slot
        self._last_used[slot] = self._num_steps
        return slot

    def _adapter(self, name: str) -> LoRAAdapter:
        """The adapter from host memory, or read again from disk (it was checked at start-up)."""
        adapter = self.adapters.get(name)
        if adapter is None:
            adapter = self._read(name)
            self.num_reads += 1
        self.adapters.move_to_end(name)
        return adapter

    def _read(self, name: str) -> LoRAAdapter:
        adapter = load_adapter(name, self.paths[name], self.spec, self.max_lora_rank)
        self.adapters[name] = adapter
        self._keep_max_cpu_loras()
        return adapter

    def _keep_max_cpu_loras(self) -> None:
        while self.max_cpu_loras is not None and len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)
