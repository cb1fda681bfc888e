"""CUDA graphs for decode steps: the whole forward (embedding -> layers -> LM head) of a decode-only
batch replays as one graph instead of hundreds of eager kernel launches (~7 us each on the GPU host,
~0.8 us inside a graph).

One graph per batch-size bucket; a batch of B sequences runs the smallest bucket >= B, padded:

    rows:          0 .. B-1 (real)              B .. bucket-1 (padding)
    input_ids      this step's tokens           0
    slot_mapping   this step's cache slots      -1   (the KV write kernel skips them)
    seq_lens       context lengths              0    (attention writes zeros, reads nothing)
    block_tables   this step's tables           stale rows, never read (seq_len 0)

query_start_loc is the constant 0..bucket (one token per row) and the block-table width is fixed
at max_model_len / block_size, so the attention kernel's launch shape never changes under replay.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from paged_llm.layers.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_graph(
    run: Callable[[], torch.Tensor], pool: object, device: torch.device
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warms `run` up twice (Triton autotuning/compilation and cuBLAS handles happen there), then
    captures it into a graph on the memory pool `pool` (None: a new one). Returns the graph and the
    output tensor its replays write.

    The warm-up runs on the stream that then captures, as PyTorch's CUDA-graph notes ask. Warmed up
    on the default stream, a capture (mixed-step bucket 32, float32 tiny Llama) failed inside cuBLAS
    with CUBLAS_STATUS_INTERNAL_ERROR in 2 of 4 GPU test runs on fresh H100 machines; warmed up here,
    3 of 3 runs passed (a fresh machine, then twice with Triton's kernel cache emptied)."""
    stream = _capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = run()
    torch.cuda.synchronize(device)
    return graph, output


def capture_buckets(
    buckets: list[int],
    run_for: Callable[[int], Callable[[], torch.Tensor]],
    pool: object | None,
    device: torch.device,
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor], object]:
    """Captures `run_for(bucket)` for every bucket, largest first, so the smaller graphs reuse the
    largest one's memory (one pool: `pool`, or the first graph's). Returns the graphs, their output
    tensors and the pool."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    for bucket in sorted(buckets, reverse=True):
        graphs[bucket], outputs[bucket] = capture_graph(run_for(bucket), pool, device)
        if pool is None:
            pool = graphs[bucket].pool()
    torch.cuda.synchronize(device)
    return graphs, outputs, pool


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every warm-up and capture: the caching allocator keeps freed
    blocks per stream, so a stream per graph would strand each warm-up's activations."""
    return torch.cuda.Stream(device)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 1025, 32)]
    capped = [s for s in sizes if s < max_num_seqs]
    return [*capped, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        """`forward(input_ids, positions, metadata) -> logits` of every row (the model + LM head)."""
        self.forward = forward
        self.device = device
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        largest = self.batch_sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=batch_size,
            num_seqs=batch_size,
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * batch_size,
            seq_lens_host=[],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first so the smaller ones reuse its memory pool."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()

        def run_for(batch_size: int) -> Callable[[], torch.Tensor]:
            args = (self.input_ids[:batch_size], self.positions[:batch_size], self._metadata(batch_size))
            return functools.partial(self.forward, *args)

        self.graphs, self.logits, self.pool = capture_buckets(
            self.batch_sizes, run_for, self.pool, self.device
        )
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def bucket(self, num_seqs: int) -> int | None:
        return next((size for size in self.batch_sizes if size >= num_seqs), None)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Replays the bucket for this decode batch; returns the logits of its real rows."""
        num_seqs = metadata.num_seqs
        bucket = self.bucket(num_seqs)
        assert bucket is not None and metadata.max_query_len == 1
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        if bucket > num_seqs:
            self.slot_mapping[num_seqs:bucket].fill_(-1)
            self.seq_lens[num_seqs:bucket].zero_()
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][:num_seqs]


def mixed_step_token_buckets(max_num_batched_tokens: int, largest: int = 2048) -> list[int]:
    """Token buckets of the mixed-step graphs. Up to 2048 tokens the eager step is bound by launching
    kernels from Python (12.9 ms eagerly for 8 x 128 prompt tokens on an H100)."""
    sizes = [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    return [s for s in sizes if s <= min(largest, max_num_batched_tokens)]


# Sequence slots of the mixed-step graphs, at most (a bucket of T tokens has min(T, this), and at
# most max_num_seqs): a step of new requests joining up to this many running ones replays a graph.
# A padding slot costs one early-exiting attention program a kv head (the flat grid: a slot does
# not multiply the bucket's query blocks) and a few bytes of copies.
MAX_MIXED_GRAPH_SEQS = 256


class MixedStepGraphs:
    """CUDA graphs for steps up to 2048 tokens that are not decode-only: a lone new request's
    prefill, or new prompts next to running decodes (the step that gives new requests their first
    token, at any load). Run eagerly, such a step spends 10-25 ms launching ~15 kernels per layer
    from Python (an H100: 2 x 128 prompt tokens took 16.6 ms eagerly, 1.5 ms of it on the GPU). One
    graph per token bucket, the bucket of T tokens with min(T, num_slots) sequence slots; a step of
    T tokens in S sequences runs the smallest bucket >= T, padded:

        tokens:        0 .. T-1 (the step's)           T .. bucket-1 (padding)
        input_ids      the step's tokens               0
        positions      their positions                 0
        slot_mapping   their cache slots               -1   (the KV write kernel skips them)
        sequences:     0 .. S-1 (the step's)           S .. slots-1 (padding)
        query_start_loc  the step's offsets            T    (query length 0: the attention
        seq_lens         context lengths               0     kernel's programs return at once)
        block_tables     the step's tables             stale rows, never read
        sample_rows      the rows to sample            0    (their logits are dropped)

    max_query_len is the bucket, so the attention kernel's launch shape never changes under replay
    (its flat grid: bucket / query block + slots programs a kv head); rows of padding tokens belong
    to no sequence and reach no real row. A graph's output is the hidden state of its sampled rows:
    the logits of the step's own rows are computed after the replay, so no graph keeps a
    [rows, vocab] output and padding rows cost no lm_head.
    """

    def __init__(
        self,
        model_forward: Callable[..., torch.Tensor],
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        buckets: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        pool: object | None = None,
        max_num_seqs: int = MAX_MIXED_GRAPH_SEQS,
        rows_per_seq: int = 1,
    ) -> None:
        """`model_forward(input_ids, positions, metadata) -> hidden`, `logits_of(rows) -> logits`.
        `max_num_seqs`: the slots of the largest buckets. `rows_per_seq`: sampled rows a sequence
        may need (1 + proposals it verifies); a bucket of B tokens keeps min(B, slots * rows_per_seq)."""
        self.model_forward = model_forward
        self.logits_of = logits_of
        self.buckets = buckets
        self.device = device
        self.max_model_len = max_model_len
        self.num_slots = max_num_seqs
        largest = buckets[-1] if buckets else 0
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.rows_per_seq = rows_per_seq
        self.sample_rows = torch.zeros(max_num_seqs * rows_per_seq, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output: its sampled rows' hidden states
        self.pool = pool
        self.num_replays = 0

    def _metadata(self, bucket: int) -> AttentionMetadata:
        slots = self.slots(bucket)
        return AttentionMetadata(
            num_tokens=bucket,
            num_seqs=slots,
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: slots + 1],
            seq_lens=self.seq_lens[:slots],
            block_tables=self.block_tables[:slots],
            max_query_len=bucket,
            max_seq_len=self.max_model_len,
            query_lens_host=[],
            seq_lens_host=[],
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        hidden = self.model_forward(self.input_ids[:bucket], self.positions[:bucket], self._metadata(bucket))
        return hidden.index_select(0, self.sample_rows[: self.num_rows(bucket)])

    def slots(self, bucket: int) -> int:
        """Sequence slots of the bucket's graph (a sequence has at least one token in the step)."""
        return min(bucket, self.num_slots)

    def num_rows(self, bucket: int) -> int:
        """Sampled rows the bucket's graph keeps."""
        return min(bucket, self.slots(bucket) * self.rows_per_seq)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, on dummy inputs (one sequence of `bucket` tokens)
        that write nothing to the cache."""

        def run_for(bucket: int) -> Callable[[], torch.Tensor]:
            self.slot_mapping.fill_(-1)
            self.query_start_loc.fill_(bucket)
            self.query_start_loc[0] = 0
            self.seq_lens.zero_()
            self.seq_lens[0] = bucket
            self.sample_rows.zero_()
            self.sample_rows[0] = bucket - 1
            return functools.partial(self._forward, bucket)

        self.graphs, self.hidden, self.pool = capture_buckets(self.buckets, run_for, self.pool, self.device)
        logger.info(
            "captured mixed-step CUDA graphs for %s tokens, up to %d sequences", self.buckets, self.num_slots
        )

    def bucket(self, num_tokens: int, num_seqs: int = 1, num_sampled: int = 1) -> int | None:
        return next(
            (
                size
                for size in self.buckets
                if size >= num_tokens and self.slots(size) >= num_seqs and self.num_rows(size) >= num_sampled
            ),
            None,
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        sample_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Replays the bucket for this step; returns the logits of `sample_indices`' rows, in order."""
        num_tokens, num_seqs = metadata.num_tokens, metadata.num_seqs
        num_sampled = sample_indices.shape[0]
        bucket = self.bucket(num_tokens, num_seqs, num_sampled)
        assert bucket is not None
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping)
        if bucket > num_tokens:
            self.input_ids[num_tokens:bucket].zero_()
            self.positions[num_tokens:bucket].zero_()
            self.slot_mapping[num_tokens:bucket].fill_(-1)
        slots = self.slots(bucket)
        self.query_start_loc[: num_seqs + 1].copy_(metadata.query_start_loc)
        self.query_start_loc[num_seqs + 1 : slots + 1].fill_(num_tokens)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.seq_lens[num_seqs:slots].zero_()
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self.sample_rows[:num_sampled].copy_(sample_indices)
        self.sample_rows[num_sampled : self.num_rows(bucket)].zero_()
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits_of(self.hidden[bucket][:num_sampled])
