"""The wire between tensor-parallel ranks (runner/tensor_parallel.py tells the protocol): the
commands, the step header (host to host, a gloo control group) and the step payload (a device
broadcast), packed from and unpacked into the runner's step inputs; and the timeouts."""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paged_llm.layers.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from paged_llm.runner.input_buffers import StepInputs

CMD_STEP, CMD_PROFILE, CMD_ALLOCATE, CMD_SHUTDOWN, CMD_LORA_STEP = 1, 2, 3, 4, 5
HEADER_SIZE = 8  # [command, T, B, W, S, max_query_len, max_seq_len, argument]
TIMEOUT_ENV = "PAGED_LLM_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint can take minutes
# A worker's wait for the next step's header: as long as the engine stays idle.
_IDLE_WAIT = datetime.timedelta(days=365)


def collective_timeout_s() -> float:
    """How long a rank waits for the others at start-up and in a step's collectives:
    PAGED_LLM_TP_TIMEOUT_S (seconds, > 0), else 600 s."""
    from paged_llm.config import ConfigError

    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=collective_timeout_s())


@dataclass
class StepHeader:
    command: int
    num_tokens: int = 0
    num_seqs: int = 0
    table_width: int = 0
    num_sample_rows: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    argument: int = 0


class Channel:
    """The header (host to host, the control group) and payload (device) broadcasts, the same
    object on every rank."""

    def __init__(self, device: torch.device, control: torch.distributed.ProcessGroup) -> None:
        self.device = device
        self.control = control
        self.header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        self._send_timeout = collective_timeout()

    def send(self, header: StepHeader, payload: torch.Tensor | None = None) -> None:
        values = [
            header.command,
            header.num_tokens,
            header.num_seqs,
            header.table_width,
            header.num_sample_rows,
            header.max_query_len,
            header.max_seq_len,
            header.argument,
        ]
        self.header = torch.tensor(values, dtype=torch.int64)
        self._broadcast_header(self._send_timeout)
        if payload is not None:
            torch.distributed.broadcast(payload, src=0)

    def receive_header(self) -> StepHeader:
        self._broadcast_header(_IDLE_WAIT)
        return StepHeader(*self.header.tolist())

    def _broadcast_header(self, timeout: datetime.timedelta) -> None:
        """Rank 0's header to every rank, host to host; returns once all have it."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = timeout
        self.control.broadcast([self.header], options).wait()

    def receive_payload(self, num_elements: int) -> torch.Tensor:
        payload = torch.empty(num_elements, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(payload, src=0)
        return payload


def payload_size(header: StepHeader) -> int:
    t, b, w, s = header.num_tokens, header.num_seqs, header.table_width, header.num_sample_rows
    return 3 * t + (b + 1) + b + b * w + s


def pack_step(inputs: StepInputs) -> tuple[StepHeader, torch.Tensor]:
    """The step's model inputs as one int64 tensor (on rank 0's device, after any pending-token copy)."""
    metadata = inputs.metadata
    tables = metadata.block_tables
    header = StepHeader(
        CMD_STEP,
        num_tokens=metadata.num_tokens,
        num_seqs=metadata.num_seqs,
        table_width=tables.shape[1],
        num_sample_rows=inputs.sample_indices.shape[0],
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
    )
    parts = [
        inputs.input_ids,
        inputs.positions,
        metadata.slot_mapping,
        metadata.query_start_loc.to(torch.int64),
        metadata.seq_lens.to(torch.int64),
        tables.reshape(-1).to(torch.int64),
        inputs.sample_indices,
    ]
    return header, torch.cat(parts)


def pack_lora_step(
    rows: list[tuple[int, int]], loads: list[tuple[int, int]], device: torch.device
) -> tuple[StepHeader, torch.Tensor]:
    """The next step's LoRA rows ((slot, tokens) per sequence) and slot loads ((slot, adapter
    index)), sent before the step itself (lora/manager.py's replay_step on the other ranks)."""
    values = [value for pair in rows for value in pair] + [value for pair in loads for value in pair]
    header = StepHeader(CMD_LORA_STEP, num_seqs=len(rows), argument=len(loads))
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":  # a pageable copy would wait for the step before it on the device
        return header, host.pin_memory().to(device, non_blocking=True)
    return header, host.to(device)


def unpack_lora_step(
    header: StepHeader, payload: torch.Tensor
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    values = payload.tolist()
    pairs = [(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return pairs[: header.num_seqs], pairs[header.num_seqs :]


def lora_payload_size(header: StepHeader) -> int:
    return 2 * (header.num_seqs + header.argument)


def unpack_step(
    header: StepHeader, payload: torch.Tensor, with_host_lists: bool
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input_ids, positions, metadata, sample_indices) as rank 0 had them. `with_host_lists`: fill
    the metadata's host copies of the lengths (the portable attention path groups by them)."""
    t, b, w, s = header.num_tokens, header.num_seqs, header.table_width, header.num_sample_rows
    sizes = [t, t, t, b + 1, b, b * w, s]
    ids, positions, slots, query_start, seq_lens, tables, sample_indices = payload.split(sizes)
    query_start = query_start.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    query_lens_host: list[int] = []
    seq_lens_host: list[int] = []
    if with_host_lists:
        starts = query_start.tolist()
        query_lens_host = [end - start for start, end in itertools.pairwise(starts)]
        seq_lens_host = seq_lens.tolist()
    metadata = AttentionMetadata(
        num_tokens=t,
        num_seqs=b,
        slot_mapping=slots,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=tables.to(torch.int32).view(b, w),
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        query_lens_host=query_lens_host,
        seq_lens_host=seq_lens_host,
    )
    return ids, positions, metadata, sample_indices
