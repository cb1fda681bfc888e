"""KV-cache blocks: reference counts, an LRU free queue, and the hash -> block map of the prefix cache.

Pure Python (no torch): the pool hands out block ids; the model runner owns the tensors they index.

A block with ref_count 0 sits in the free queue but may still hold a cached prefix (its `block_hash`
is set). Allocation takes blocks from the head of the queue (least recently freed first) and evicts
their hash entry; a prefix-cache hit on a free block pulls it out of the middle of the queue:

    free queue: head -> [b7 (cached h3)] <-> [b2] <-> [b9 (cached h8)] <- tail
    allocate(1)  -> b7, evicts h3         touch([b9]) -> b9 leaves the queue, ref_count 1
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0  # requests whose block table holds this block
    block_hash: BlockHash | None = None  # set once the block is full and its KV computed
    prev_free: KVBlock | None = None  # free-queue links (None when not queued, or at an end)
    next_free: KVBlock | None = None
    is_queued: bool = False

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop-head, push-tail and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        assert not block.is_queued, f"{block} is already in the free queue"
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.is_queued = True
        self.num_blocks += 1

    def popleft(self) -> KVBlock:
        if self._head is None:
            raise IndexError("no free KV blocks")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.is_queued, f"{block} is not in the free queue"
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.is_queued = False
        self.num_blocks -= 1

    def __iter__(self):
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        allocated = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_count == 0, block
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Takes a reference on prefix-cache hits; a hit on a free block leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the tail of the free queue.

        Callers pass a request's blocks last-first, so its tail blocks (least likely to be shared)
        are evicted before its prefix.
        """
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Registers a full, computed block under its hash (first writer owns the entry)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (after an engine fault, cached KV may be garbage)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        # Another block may own the entry (the same prefix computed twice): leave it alone.
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def check_integrity(self) -> None:
        """Asserts the free queue, ref counts and hash map agree (cheap enough for every test step)."""
        queued = list(self.free_queue)
        assert len(queued) == self.free_queue.num_blocks, "free-queue length out of sync"
        assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert block.is_queued == (block.ref_count == 0), f"queued flag wrong for {block}"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"hash map entry points at {block} with another hash"
        assert self.num_free_blocks == sum(1 for b in self.blocks if b.ref_count == 0)
