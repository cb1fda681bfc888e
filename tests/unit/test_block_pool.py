"""BlockPool and FreeBlockQueue: exact block ids, LRU free-queue order, ref counts, prefix-cache eviction.

In the style of vLLM's tests/v1/core/test_prefix_caching.py: every test asserts the exact ids handed out
and the exact free-queue order, because the order *is* the eviction policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from paged_llm.core.block_pool import BlockHash, BlockPool, FreeBlockQueue, KVBlock


def h(name: str) -> BlockHash:
    """A readable fake block hash (real ones are 16-byte blake2b digests; the pool never looks inside)."""
    return name.encode().ljust(16, b".")


def ids(blocks: Sequence[KVBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def cache_all(pool: BlockPool, blocks: Sequence[KVBlock], prefix: str) -> list[BlockHash]:
    """Registers each block under its own hash `prefix0`, `prefix1`, ... and returns the hashes."""
    hashes = [h(f"{prefix}{index}") for index in range(len(blocks))]
    for block, block_hash in zip(blocks, hashes):
        pool.cache_block(block, block_hash)
    return hashes


def release(pool: BlockPool, blocks: Sequence[KVBlock]) -> None:
    """Frees a request's blocks the way KVCacheManager.free does: last block first."""
    pool.free(reversed(blocks))


# --------------------------------------------------------------------------------- FreeBlockQueue
def test_free_queue_keeps_insertion_order_and_removes_anywhere() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.num_blocks == 5

    queue.remove(blocks[2])  # middle
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert queue.block_ids() == [1, 3]
    assert queue.num_blocks == 2
    assert not blocks[2].is_queued and blocks[2].prev_free is None and blocks[2].next_free is None

    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 0]
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[3]
    assert queue.popleft() is blocks[0]
    assert queue.block_ids() == [] and queue.num_blocks == 0
    with pytest.raises(IndexError):
        queue.popleft()
    # The emptied queue is reusable: head and tail were reset, not left dangling.
    queue.append(blocks[4])
    assert queue.block_ids() == [4]


def test_free_queue_rejects_double_append_and_removing_unqueued() -> None:
    block = KVBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(AssertionError):
        queue.append(block)
    queue.remove(block)
    with pytest.raises(AssertionError):
        queue.remove(block)


# ------------------------------------------------------------------------------------- allocate
def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_hands_out_ids_from_the_head_in_order() -> None:
    pool = BlockPool(10)
    first = pool.allocate(3)
    assert ids(first) == [0, 1, 2]
    assert [b.ref_count for b in first] == [1, 1, 1]
    assert not any(b.is_queued for b in first)
    assert ids(pool.allocate(2)) == [3, 4]
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 9]
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(0.5)
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.free_queue.block_ids() == [3]
    assert pool.blocks[3].ref_count == 0
    pool.check_integrity()


# ----------------------------------------------------------------------------------------- free
def test_free_last_first_puts_the_request_tail_at_the_eviction_end() -> None:
    pool = BlockPool(10)
    request_blocks = pool.allocate(4)  # [0, 1, 2, 3]
    release(pool, request_blocks)
    # Freed blocks join the tail, the request's last block first: it is the first of them to go.
    assert pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert all(b.ref_count == 0 and b.is_queued for b in request_blocks)
    # Never-used blocks at the head go first, then the freed request's tail before its prefix.
    assert ids(pool.allocate(7)) == [4, 5, 6, 7, 8, 9, 3]
    assert pool.free_queue.block_ids() == [2, 1, 0]
    pool.check_integrity()


def test_free_order_across_requests_is_least_recently_freed_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    release(pool, b)
    release(pool, a)
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]


def test_double_free_asserts() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])
    assert block.ref_count == 0
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]  # not queued twice
    pool.check_integrity()


def test_never_allocated_block_cannot_be_freed() -> None:
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free([pool.blocks[1]])


# -------------------------------------------------------------------------------- sharing, touch
def test_shared_block_ref_counts_and_return_to_queue_on_last_release() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # [0, 1], held by request A
    cache_all(pool, blocks, "a")
    pool.touch(blocks)  # request B hits A's prefix while A still runs
    assert [b.ref_count for b in blocks] == [2, 2]
    assert pool.num_free_blocks == 2  # a hit on a held block takes nothing from the free queue

    release(pool, blocks)  # A finishes
    assert [b.ref_count for b in blocks] == [1, 1]
    assert pool.free_queue.block_ids() == [2, 3]

    release(pool, blocks)  # B finishes: only now do they become evictable
    assert [b.ref_count for b in blocks] == [0, 0]
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    pool.check_integrity()


def test_touch_on_free_cached_block_removes_it_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)  # [0 .. 4]
    hashes = cache_all(pool, blocks, "p")
    release(pool, blocks)
    assert pool.free_queue.block_ids() == [5, 6, 7, 4, 3, 2, 1, 0]

    pool.touch([pool.get_cached_block(hashes[2])])  # a later request hits block 2 only
    assert pool.blocks[2].ref_count == 1
    assert not pool.blocks[2].is_queued
    assert pool.free_queue.block_ids() == [5, 6, 7, 4, 3, 1, 0]
    assert pool.num_free_blocks == 7
    # The hit keeps its hash: it is in use, not evicted.
    assert pool.get_cached_block(hashes[2]) is pool.blocks[2]
    assert pool.num_evictions == 0

    # Touching the head and the tail of the queue keeps the links consistent too.
    pool.touch([pool.blocks[5], pool.blocks[0]])
    assert pool.free_queue.block_ids() == [6, 7, 4, 3, 1]
    pool.check_integrity()


# ---------------------------------------------------------------------------------- LRU eviction
def test_lru_eviction_order_of_cached_blocks() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(3)  # [3, 4, 5]
    ha = cache_all(pool, a, "a")
    hb = cache_all(pool, b, "b")
    release(pool, a)  # A ends first: its blocks are the least recently used
    release(pool, b)
    assert pool.free_queue.block_ids() == [2, 1, 0, 5, 4, 3]
    assert len(pool.cached_blocks) == 6

    # One block needed: A's tail goes first; everything else stays hittable.
    assert ids(pool.allocate(1)) == [2]
    assert pool.get_cached_block(ha[2]) is None
    assert pool.blocks[2].block_hash is None
    assert pool.num_evictions == 1
    assert all(pool.get_cached_block(x) is not None for x in [ha[0], ha[1], *hb])

    # Two more: the rest of A (its prefix last), B untouched.
    assert ids(pool.allocate(2)) == [1, 0]
    assert pool.get_cached_block(ha[1]) is None and pool.get_cached_block(ha[0]) is None
    assert [pool.get_cached_block(x) for x in hb] == b
    assert pool.num_evictions == 3
    pool.check_integrity()


def test_reuse_of_a_cached_block_makes_it_most_recently_used() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # [0, 1]
    hashes = cache_all(pool, blocks, "x")
    release(pool, blocks)
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]

    hit = pool.get_cached_block(hashes[1])
    pool.touch([hit])  # block 1 (the request's tail, next to be evicted) is used again ...
    assert pool.free_queue.block_ids() == [2, 3, 0]
    pool.free([hit])  # ... and released: now it is the most recently used
    assert pool.free_queue.block_ids() == [2, 3, 0, 1]
    assert ids(pool.allocate(3)) == [2, 3, 0]
    assert pool.get_cached_block(hashes[1]) is pool.blocks[1]
    assert pool.get_cached_block(hashes[0]) is None


def test_allocating_uncached_blocks_counts_no_evictions() -> None:
    pool = BlockPool(4)
    release(pool, pool.allocate(4))
    pool.allocate(4)
    assert pool.num_evictions == 0
    assert pool.cached_blocks == {}


# --------------------------------------------------------------------------- duplicate hashes
def test_cache_block_first_writer_owns_the_hash_entry() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)  # the same prefix computed twice in one step
    pool.cache_block(first, h("same"))
    pool.cache_block(second, h("same"))
    assert pool.get_cached_block(h("same")) is first
    assert first.block_hash == h("same") and second.block_hash == h("same")
    pool.check_integrity()


def test_evicting_a_duplicate_keeps_the_owner_entry() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    pool.cache_block(first, h("same"))
    pool.cache_block(second, h("same"))
    pool.free([second])
    pool.free([first])
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]

    pool.allocate(3)  # evicts 2, 3 (uncached) and then the duplicate, block 1
    assert second.block_hash is None
    assert pool.get_cached_block(h("same")) is first  # the map pointed at block 0: untouched
    assert pool.num_evictions == 0  # the duplicate never owned an entry

    pool.allocate(1)  # block 0, the owner
    assert pool.get_cached_block(h("same")) is None
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_evicting_the_owner_before_the_duplicate_does_not_fail() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache_block(first, h("same"))
    pool.cache_block(second, h("same"))
    pool.free([first])
    pool.free([second])
    assert ids(pool.allocate(1)) == [0]
    assert pool.get_cached_block(h("same")) is None
    # The duplicate still carries the hash but owns no entry; evicting it must not delete anything.
    assert second.block_hash == h("same")
    assert ids(pool.allocate(1)) == [1]
    assert second.block_hash is None
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_cache_block_keeps_the_first_hash_of_a_block() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, h("one"))
    pool.cache_block(block, h("two"))
    assert block.block_hash == h("one")
    assert pool.get_cached_block(h("two")) is None
    assert pool.get_cached_block(h("one")) is block


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_block(block, h("x"))
    assert block.block_hash is None
    assert pool.cached_blocks == {}
    assert pool.get_cached_block(h("x")) is None


# ------------------------------------------------------------------------------ reset, integrity
def test_reset_prefix_cache_forgets_every_hash_but_keeps_allocation_state() -> None:
    pool = BlockPool(6)
    held = pool.allocate(2)  # [0, 1], still held
    freed = pool.allocate(2)  # [2, 3], freed but cached
    held_hashes = cache_all(pool, held, "held")
    freed_hashes = cache_all(pool, freed, "freed")
    release(pool, freed)
    queue_before = pool.free_queue.block_ids()

    pool.reset_prefix_cache()

    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert all(pool.get_cached_block(x) is None for x in held_hashes + freed_hashes)
    assert pool.free_queue.block_ids() == queue_before
    assert [b.ref_count for b in pool.blocks] == [1, 1, 0, 0, 0, 0]
    pool.allocate(4)
    assert pool.num_evictions == 0  # nothing left to evict
    pool.check_integrity()


def test_check_integrity_passes_through_a_busy_lifecycle() -> None:
    pool = BlockPool(8)
    pool.check_integrity()
    a = pool.allocate(3)
    cache_all(pool, a, "a")
    pool.touch(a[:2])
    pool.check_integrity()
    release(pool, a)
    pool.check_integrity()
    pool.free(reversed(a[:2]))
    pool.check_integrity()
    pool.touch([a[1]])
    pool.allocate(pool.num_free_blocks)
    pool.check_integrity()


def _queued_block_with_a_reference(pool: BlockPool) -> None:
    pool.blocks[5].ref_count = 1  # held, but still in the free queue


def _held_block_with_ref_count_zero(pool: BlockPool) -> None:
    pool.blocks[0].ref_count = 0  # freed without joining the queue (would leak forever)


def _hash_entry_points_at_another_block(pool: BlockPool) -> None:
    pool.cached_blocks[h("a0")] = pool.blocks[1]  # block 1 holds h("a1")


def _queue_length_off_by_one(pool: BlockPool) -> None:
    pool.free_queue.num_blocks += 1


def _block_unlinked_but_still_flagged(pool: BlockPool) -> None:
    # Splice block 4 out of the links without telling anyone (a broken remove()).
    victim = pool.blocks[4]
    assert victim.prev_free is not None and victim.next_free is not None
    victim.prev_free.next_free = victim.next_free
    victim.next_free.prev_free = victim.prev_free


def _negative_ref_count(pool: BlockPool) -> None:
    pool.blocks[1].ref_count = -1


@pytest.mark.parametrize(
    "corrupt",
    [
        _queued_block_with_a_reference,
        _held_block_with_ref_count_zero,
        _hash_entry_points_at_another_block,
        _queue_length_off_by_one,
        _block_unlinked_but_still_flagged,
        _negative_ref_count,
    ],
)
def test_check_integrity_detects_corruption(corrupt: Callable[[BlockPool], None]) -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)  # [0, 1, 2] held; 3 .. 7 free
    cache_all(pool, blocks, "a")
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()
