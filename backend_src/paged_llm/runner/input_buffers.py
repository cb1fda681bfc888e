"""Step inputs built into buffers that live as long as the runner.

Host buffers are pinned (on accelerators), filled with numpy, and copied to same-shaped device
buffers with non-blocking copies: no allocation per step, no host synchronisation. The next step
refills the host buffers only after the previous step's sampled tokens were fetched (the one sync),
by which time its copies have long completed.

    host (pinned)  --copy_(non_blocking)-->  device         sliced to this step's sizes:
    input_ids[:T], positions[:T], slot_mapping[:T], query_start_loc[:B+1], seq_lens[:B],
    block_tables[:B * W] viewed as [B, W] (W = widest block table of the step), sample_indices[:S]

With asynchronous scheduling the next step is prepared while the previous one still runs: a decode
whose input token is still pending (its value is on the device, not yet on the host) gets it by a
device-side copy from the previous step's sampled tokens, and the host buffers are refilled only
after an event says the previous upload left them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_llm.core.scheduler import SchedulerOutput
from paged_llm.layers.attention.metadata import AttentionMetadata
from paged_llm.sampling.verify import VerifyRows
from paged_llm.sequence import PENDING_TOKEN, Sequence


@dataclass
class PendingTokens:
    """Where the previous step's tokens will be (row `row_of[seq_id]` of its sampled token ids): a
    step launched before they reach the host (maybe before they are even sampled) reads them on the
    device, through `InputBuffers.fill_pending`."""

    row_of: dict[str, int]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the hidden states that produce logits
    sampled_seqs: list[Sequence]  # the sequences sampling one token this step, in row order
    # Speculative decoding: the sequences verifying proposals (d + 1 logits rows each), and the
    # logits rows of `sampled_seqs` among all S rows (None: no verification, row i is sampled_seqs[i]).
    verify_rows: VerifyRows | None = None
    sampled_rows: torch.Tensor | None = None
    # input_ids rows that take the previous step's tokens, and their rows there (device tensors):
    # InputBuffers.fill_pending copies them in
    pending_copy: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.metadata.max_query_len == 1


class InputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size_tokens: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.block_size_tokens = block_size_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.pin_memory = pin_memory
        sizes = {
            "input_ids": (max_num_tokens, torch.int64),
            "positions": (max_num_tokens, torch.int64),
            "slot_mapping": (max_num_tokens, torch.int64),
            "query_start_loc": (max_num_seqs + 1, torch.int32),
            "seq_lens": (max_num_seqs, torch.int32),
            "block_tables": (max_num_seqs * max_blocks_per_seq, torch.int32),
            "sample_indices": (max_num_tokens, torch.int64),  # one per sequence, d + 1 if verifying
            "sampled_rows": (max_num_seqs, torch.int64),
            "pending_rows": (max_num_seqs, torch.int64),  # input rows whose token is pending
            "pending_sources": (max_num_seqs, torch.int64),  # their rows in PendingTokens.token_ids
        }
        self.host = {n: torch.zeros(s, dtype=d, pin_memory=pin_memory) for n, (s, d) in sizes.items()}
        self.host_np = {n: t.numpy() for n, t in self.host.items()}
        on_device = device.type != "cpu"
        self.dev = (
            {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in sizes.items()} if on_device else None
        )
        self._uploaded = None  # device event after the last step's uploads (None on CPU)
        self._new_event = getattr(torch, device.type).Event if on_device else None

    def _upload(self, name: str, count: int) -> torch.Tensor:
        host = self.host[name][:count]
        if self.dev is None:
            return host
        target = self.dev[name][:count]
        target.copy_(host, non_blocking=self.pin_memory)
        return target

    def prepare(self, scheduler_output: SchedulerOutput, pending: PendingTokens | None = None) -> StepInputs:
        """The step's inputs, uploaded; rows whose token the previous step has not delivered yet
        (`pending`) hold 0 until `fill_pending` copies the tokens in (enqueued after whatever
        samples them: this host work need not wait for that)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's uploads have left the host buffers
        block_size = self.block_size_tokens
        scheduled = scheduler_output.scheduled
        num_seqs = len(scheduled)
        num_tokens = scheduler_output.num_batched_tokens
        width = max(len(item.block_ids) for item in scheduled)
        ids_np, pos_np, slot_np = (
            self.host_np["input_ids"],
            self.host_np["positions"],
            self.host_np["slot_mapping"],
        )
        tables_np = self.host_np["block_tables"][: num_seqs * width].reshape(num_seqs, width)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        verify: VerifyRows | None = None
        sampled_logit_rows: list[int] = []  # logits row of each of sampled_seqs
        cursor = 0
        for row, item in enumerate(scheduled):
            start, num_new = item.num_computed_tokens, item.num_new_tokens
            end = cursor + num_new
            block_ids = item.block_ids
            tables_np[row, : len(block_ids)] = block_ids
            drafts = item.draft_token_ids
            if num_new == 1 and not drafts:  # decode: plain Python beats numpy for one element
                token_id = item.seq.all_token_ids[start]
                if token_id == PENDING_TOKEN:
                    assert pending is not None, f"{item.seq_id}: pending input token without its step"
                    pending_rows.append(cursor)
                    pending_sources.append(pending.row_of[item.seq_id])
                    token_id = 0
                ids_np[cursor] = token_id
                pos_np[cursor] = start
                slot_np[cursor] = block_ids[start // block_size] * block_size + start % block_size
            else:
                if drafts:  # the last known token, then the proposals it verifies
                    token_id = item.seq.all_token_ids[start]
                    assert token_id != PENDING_TOKEN, f"{item.seq_id}: verifying after a pending token"
                    ids_np[cursor] = token_id
                    ids_np[cursor + 1 : end] = drafts
                else:
                    assert start + num_new <= item.seq.num_known_tokens, (
                        f"{item.seq_id}: a chunk with a pending token"
                    )
                    ids_np[cursor:end] = item.seq.all_token_ids[start : start + num_new]
                table = np.asarray(block_ids, dtype=np.int64)
                pos = np.arange(start, start + num_new, dtype=np.int64)
                pos_np[cursor:end] = pos
                slot_np[cursor:end] = table[pos // block_size] * block_size + pos % block_size
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            cursor = end
            if drafts:
                if verify is None:
                    verify = VerifyRows([], [], [])
                verify.seqs.append(item.seq)
                verify.drafts.append(drafts)
                verify.first_rows.append(len(sample_rows))
                sample_rows.extend(range(end - num_new, end))
            elif item.needs_sample:
                sampled_logit_rows.append(len(sample_rows))
                sample_rows.append(end - 1)
                sampled_seqs.append(item.seq)
        assert cursor == num_tokens, f"scheduled {cursor} tokens, output says {num_tokens}"
        query_start = self.host_np["query_start_loc"]
        query_start[0] = 0
        np.cumsum(query_lens, out=query_start[1 : num_seqs + 1])
        self.host_np["seq_lens"][:num_seqs] = seq_lens
        self.host_np["sample_indices"][: len(sample_rows)] = sample_rows
        block_tables = self._upload("block_tables", num_seqs * width).view(num_seqs, width)
        metadata = AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            slot_mapping=self._upload("slot_mapping", num_tokens),
            query_start_loc=self._upload("query_start_loc", num_seqs + 1),
            seq_lens=self._upload("seq_lens", num_seqs),
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        input_ids = self._upload("input_ids", num_tokens)
        pending_copy = None
        if pending_rows:
            self.host_np["pending_rows"][: len(pending_rows)] = pending_rows
            self.host_np["pending_sources"][: len(pending_sources)] = pending_sources
            pending_copy = (
                self._upload("pending_rows", len(pending_rows)),
                self._upload("pending_sources", len(pending_sources)),
            )
        positions = self._upload("positions", num_tokens)
        sample_indices = self._upload("sample_indices", len(sample_rows))
        sampled_rows = None
        if verify is not None:
            self.host_np["sampled_rows"][: len(sampled_logit_rows)] = sampled_logit_rows
            sampled_rows = self._upload("sampled_rows", len(sampled_logit_rows))
        if self._new_event is not None:
            self._uploaded = self._new_event()
            self._uploaded.record()
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            sample_indices=sample_indices,
            sampled_seqs=sampled_seqs,
            verify_rows=verify,
            sampled_rows=sampled_rows,
            pending_copy=pending_copy,
        )

    @staticmethod
    def fill_pending(inputs: StepInputs, token_ids: torch.Tensor | None) -> None:
        """Copies the previous step's tokens (`token_ids`, its sampled ids on the device) into the
        rows `prepare` left pending."""
        if inputs.pending_copy is None:
            return
        assert token_ids is not None, "pending input tokens without the step that samples them"
        rows, sources = inputs.pending_copy
        inputs.input_ids.index_copy_(0, rows, token_ids.index_select(0, sources))
        inputs.pending_copy = None
