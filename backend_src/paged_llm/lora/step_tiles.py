"""A step's adapter rows as the LoRA kernels read them (lora/kernels.py): the rows of adapter rows
grouped by slot, and tiles of at most `tile_rows` of them of one slot, built on the host with numpy
into a pinned buffer and uploaded with one non-blocking copy into a device buffer that lives as long
as the runner (the CUDA graphs captured with adapters read it).

    buffer:  rows [max_num_tokens] | tile_slot [max_tiles] | tile_start [max_tiles] | tile_end [max_tiles]

Tiles past the step's own are empty (start == end == 0): the kernels' programs for them return.
As runner/input_buffers.py does, the host buffer is rewritten only after an event says the previous
upload has left it (asynchronous scheduling prepares a step while the last one runs).
"""

from __future__ import annotations

import numpy as np
import torch

from paged_llm.lora.kernels import LaunchShape, StepTileTensors, tile_rows


class StepTiles:
    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_tokens = max_num_tokens
        self.num_slots = num_slots
        self.max_tiles = LaunchShape.of(max_num_tokens, num_slots).num_tiles
        size = max_num_tokens + 3 * self.max_tiles
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin_memory)
        self.host_np = self.host.numpy()
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        parts = torch.split(self.device_buffer, [max_num_tokens, *(self.max_tiles,) * 3])
        self.tensors = StepTileTensors(*parts)
        self._pin_memory = pin_memory
        self._uploaded: torch.cuda.Event | None = None
        self.num_tiles = 0  # the last step's

    def set(self, token_slots: list[tuple[int, int]]) -> None:
        """Uploads the tiles of a step whose sequences have (slot or NO_ADAPTER (< 0), tokens) each,
        in the flat batch's order."""
        slots = np.array([slot for slot, _ in token_slots], dtype=np.int32)
        counts = np.array([count for _, count in token_slots], dtype=np.int64)
        num_tokens = int(counts.sum())
        assert num_tokens <= self.max_num_tokens, (num_tokens, self.max_num_tokens)
        row_slots = np.repeat(slots, counts)
        adapter_rows = np.flatnonzero(row_slots >= 0)
        order = np.argsort(row_slots[adapter_rows], kind="stable")
        rows = adapter_rows[order]
        sorted_slots = row_slots[rows]
        groups = np.unique(sorted_slots, return_index=True, return_counts=True)
        step = tile_rows(num_tokens)
        tile_slot, tile_start, tile_end = [], [], []
        for slot, start, count in zip(*(part.tolist() for part in groups), strict=True):
            starts = range(start, start + count, step)
            tile_slot.extend([slot] * len(starts))
            tile_start.extend(starts)
            tile_end.extend(min(s + step, start + count) for s in starts)
        num_tiles = len(tile_slot)
        assert num_tiles <= LaunchShape.of(num_tokens, self.num_slots).num_tiles
        if self._uploaded is not None:
            self._uploaded.synchronize()
        host, n, t = self.host_np, self.max_num_tokens, self.max_tiles
        host[: len(rows)] = rows
        for offset, values in ((n, tile_slot), (n + t, tile_start), (n + 2 * t, tile_end)):
            host[offset : offset + num_tiles] = values
            # the last step's tiles past this one's become empty
            host[offset + num_tiles : offset + max(num_tiles, self.num_tiles)] = 0
        self.num_tiles = num_tiles
        self.device_buffer.copy_(self.host, non_blocking=self._pin_memory)
        if self.device_buffer.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def clear(self) -> None:
        """No adapter rows: every tile empty (a graph captured with adapters then adds nothing)."""
        self.set([])
