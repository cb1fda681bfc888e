"""KVCacheManager: chained block hashes, prefix-cache lookups, slot allocation with exact block ids,
all-or-nothing failure, registration of computed blocks, freeing and stats.

Block size 4 throughout, so block i of a sequence holds tokens [4i, 4i + 4).
"""

from __future__ import annotations

from collections import abc

import pytest

from paged_llm.core.block_pool import KVBlock
from paged_llm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from paged_llm.sampling_params import SamplingParams
from paged_llm.sequence import Sequence

BLOCK = 4


def make_kv(num_blocks: int = 10, caching: bool = True, salt: bytes = b"") -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching, hash_salt=salt)


def make_sequence(seq_id: str, tokens: abc.Sequence[int]) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=4),
        seed=0,
    )


def ids(blocks: abc.Sequence[KVBlock] | None) -> list[int]:
    assert blocks is not None
    return [block.block_id for block in blocks]


def admit(kv: KVCacheManager, seq: Sequence, num_new: int | None = None) -> list[KVBlock]:
    """Does what the scheduler does for a waiting sequence: lookup, allocate, mark hits computed."""
    hits, num_hit_tokens = kv.get_computed_blocks(seq)
    if num_new is None:
        num_new = seq.num_tokens - num_hit_tokens
    new_blocks = kv.allocate_slots(seq, num_new, hits)
    assert new_blocks is not None
    seq.num_computed_tokens = num_hit_tokens
    return new_blocks


def compute(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    """Does what update_from_output does after a step computed `num_tokens` more tokens."""
    seq.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(seq)


def run_prompt(kv: KVCacheManager, seq: Sequence) -> None:
    """Admits the sequence and computes its whole prompt in one step."""
    admit(kv, seq)
    compute(kv, seq, seq.num_tokens - seq.num_computed_tokens)


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything allocate_slots could change, to check that a failed call changed nothing."""
    return (
        kv.pool.free_queue.block_ids(),
        [b.ref_count for b in kv.pool.blocks],
        [b.block_hash for b in kv.pool.blocks],
        dict(kv.pool.cached_blocks),
        {rid: ids(blocks) for rid, blocks in kv.seq_to_blocks.items()},
        dict(kv.num_cached_blocks),
        kv.pool.num_evictions,
    )


# ---------------------------------------------------------------------------------------- hashes
def test_block_hash_is_deterministic_and_depends_on_tokens_order_parent_and_salt() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4], b"")
    assert base == hash_block_tokens(None, [1, 2, 3, 4], b"")
    assert len(base) == 16
    assert base != hash_block_tokens(None, [1, 2, 3, 5], b"")
    assert base != hash_block_tokens(None, [4, 3, 2, 1], b"")  # order matters, not the token multiset
    assert base != hash_block_tokens(base, [1, 2, 3, 4], b"")  # the same tokens after a parent block
    other_parent = hash_block_tokens(None, [9, 9, 9, 9], b"")
    assert hash_block_tokens(base, [5, 6, 7, 8], b"") != hash_block_tokens(other_parent, [5, 6, 7, 8], b"")
    assert base != hash_block_tokens(None, [1, 2, 3, 4], b"model-b")
    model_a = hash_block_tokens(None, [1, 2, 3, 4], b"model-a")
    assert model_a != hash_block_tokens(None, [1, 2, 3, 4], b"model-b")


def test_request_block_hashes_chain_through_the_prefix() -> None:
    kv = make_kv()
    repeated = make_sequence("r", [1, 2, 3, 4, 1, 2, 3, 4, 7, 7])
    kv.update_block_hashes(repeated)
    # Two full blocks (the 2 trailing tokens form a partial block, which has no hash).
    assert len(repeated.block_hashes) == 2
    # Identical token blocks at different positions hash differently: the hash names the prefix.
    assert repeated.block_hashes[0] != repeated.block_hashes[1]
    assert repeated.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4], b"")
    assert repeated.block_hashes[1] == hash_block_tokens(repeated.block_hashes[0], [1, 2, 3, 4], b"")

    same_second_block = make_sequence("s", [9, 9, 9, 9, 1, 2, 3, 4])
    kv.update_block_hashes(same_second_block)
    assert same_second_block.block_hashes[1] != repeated.block_hashes[1]

    twin = make_sequence("t", [1, 2, 3, 4, 1, 2, 3, 4])
    kv.update_block_hashes(twin)
    assert twin.block_hashes == repeated.block_hashes


def test_salt_changes_every_block_hash() -> None:
    tokens = list(range(12))
    plain, salted = make_sequence("p", tokens), make_sequence("s", tokens)
    make_kv().update_block_hashes(plain)
    make_kv(salt=b"another-model").update_block_hashes(salted)
    assert len(plain.block_hashes) == len(salted.block_hashes) == 3
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes))


def test_salted_managers_do_not_share_cached_prefixes() -> None:
    tokens = list(range(9))
    kv = make_kv(salt=b"a")
    run_prompt(kv, make_sequence("a", tokens))
    other = make_sequence("b", tokens)
    salted_kv = make_kv(salt=b"b")
    salted_kv.pool = kv.pool  # the same pool, looked up with another salt
    assert salted_kv.get_computed_blocks(other) == ([], 0)


def test_update_block_hashes_extends_over_output_tokens() -> None:
    kv = make_kv()
    seq = make_sequence("r", list(range(10)))
    kv.update_block_hashes(seq)
    first_two = list(seq.block_hashes)
    seq.append_output_token(50)
    kv.update_block_hashes(seq)
    assert seq.block_hashes == first_two  # 11 tokens: still 2 full blocks
    seq.append_output_token(51)
    kv.update_block_hashes(seq)
    assert seq.block_hashes[:2] == first_two
    # The prompt/output boundary is invisible to the hash: only the token sequence counts.
    as_prompt = make_sequence("p", [*range(10), 50, 51])
    kv.update_block_hashes(as_prompt)
    assert seq.block_hashes == as_prompt.block_hashes


# ---------------------------------------------------------------------------- get_computed_blocks
def test_lookup_hits_exactly_the_full_cached_blocks() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(10)))
    run_prompt(kv, a)  # blocks [0, 1, 2]; 0 and 1 are full and cached, 2 is partial
    assert ids(kv.seq_to_blocks["a"]) == [0, 1, 2]
    assert len(kv.pool.cached_blocks) == 2

    longer = make_sequence("b", [*range(10), 100, 101, 102])
    hits, num_tokens = kv.get_computed_blocks(longer)
    assert ids(hits) == [0, 1] and num_tokens == 8  # block 2 of A was partial: never a hit

    diverging = make_sequence("c", [0, 1, 2, 3, 4, 5, 99, 7, 8])
    hits, num_tokens = kv.get_computed_blocks(diverging)
    assert ids(hits) == [0] and num_tokens == 4

    other_first_block = make_sequence("d", [9, 9, 9, 9, 4, 5, 6, 7, 8])
    assert kv.get_computed_blocks(other_first_block) == ([], 0)  # block 1 matches, but not its parent


@pytest.mark.parametrize(
    ("num_prompt_tokens", "expected_hit_blocks"),
    [
        (4, 0),  # one full block: its last token must still be computed
        (5, 1),
        (7, 1),
        (8, 1),  # exactly two full cached blocks: only one is served, the last token is recomputed
        (9, 2),
        (12, 2),
        (13, 3),
    ],
)
def test_lookup_never_serves_the_last_token(num_prompt_tokens: int, expected_hit_blocks: int) -> None:
    kv = make_kv()
    run_prompt(kv, make_sequence("warm", list(range(16))))  # caches 4 full blocks [0 .. 3]
    seq = make_sequence("r", list(range(num_prompt_tokens)))
    hits, num_tokens = kv.get_computed_blocks(seq)
    assert ids(hits) == list(range(expected_hit_blocks))
    assert num_tokens == expected_hit_blocks * BLOCK
    assert num_tokens < seq.num_tokens


def test_lookup_stops_at_the_first_missing_block() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(13)))
    run_prompt(kv, a)  # 3 full cached blocks
    del kv.pool.cached_blocks[a.block_hashes[1]]  # as if block 1's entry were gone
    hits, _ = kv.get_computed_blocks(make_sequence("b", list(range(13))))
    assert ids(hits) == [0]  # block 2 is still cached, but a hit must be a prefix


def test_lookup_with_caching_disabled_finds_nothing_and_counts_nothing() -> None:
    kv = make_kv(caching=False)
    run_prompt(kv, make_sequence("a", list(range(10))))
    assert kv.pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_sequence("b", list(range(10)))) == ([], 0)
    assert kv.num_prefix_queried_tokens == 0 and kv.num_prefix_hit_tokens == 0


def test_lookup_for_a_request_that_holds_blocks_asserts() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(6)))
    admit(kv, a)
    with pytest.raises(AssertionError):
        kv.get_computed_blocks(a)


def test_prefix_stats_count_queried_and_hit_tokens_at_admission() -> None:
    kv = make_kv()
    run_prompt(kv, make_sequence("a", list(range(10))))  # queried 10, hit 0
    admit(kv, make_sequence("b", list(range(9))))  # queried 9, hit 8
    admit(kv, make_sequence("c", [*range(4), 50, 51]))  # queried 6, hit 4
    kv.get_computed_blocks(make_sequence("d", [7]))  # a lookup alone is no admission: not counted
    assert kv.num_prefix_queried_tokens == 10 + 9 + 6
    assert kv.num_prefix_hit_tokens == 0 + 8 + 4


def test_prefix_stats_count_a_blocked_sequence_once() -> None:
    kv = make_kv(num_blocks=4)
    run_prompt(kv, make_sequence("a", list(range(12))))  # 3 of 4 blocks held, 3 cached
    blocked = make_sequence("b", [*range(8), *range(100, 108)])  # 16 tokens: 2 hits + 2 new blocks
    for _ in range(3):  # the scheduler retries the head of the queue every step
        hits, _ = kv.get_computed_blocks(blocked)
        assert kv.allocate_slots(blocked, 8, hits) is None
    assert (kv.num_prefix_queried_tokens, kv.num_prefix_hit_tokens) == (12, 0)
    kv.free(make_sequence("a", []))
    admit(kv, blocked)
    assert (kv.num_prefix_queried_tokens, kv.num_prefix_hit_tokens) == (12 + 16, 8)


# ---------------------------------------------------------------------------------- allocate_slots
def test_allocate_new_requests_gets_consecutive_ids() -> None:
    kv = make_kv()
    a, b = make_sequence("a", list(range(10))), make_sequence("b", list(range(100, 105)))
    assert ids(kv.allocate_slots(a, 10)) == [0, 1, 2]
    assert ids(kv.allocate_slots(b, 5)) == [3, 4]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_block_ids("b") == [3, 4]
    assert kv.get_block_ids("missing") == []
    assert kv.num_free_blocks == 5
    assert kv.num_cached_blocks == {"a": 0, "b": 0}
    kv.check_integrity()


def test_chunked_allocation_only_covers_the_chunk() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(10)))
    assert ids(kv.allocate_slots(a, 5)) == [0, 1]  # tokens [0, 5)
    compute(kv, a, 5)
    assert ids(kv.allocate_slots(a, 3)) == []  # tokens [5, 8) fit in block 1
    compute(kv, a, 3)
    assert ids(kv.allocate_slots(a, 2)) == [2]  # tokens [8, 10)
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_decode_grows_a_block_only_when_crossing_a_boundary() -> None:
    kv = make_kv()
    a, b = make_sequence("a", list(range(10))), make_sequence("b", list(range(100, 105)))
    run_prompt(kv, a)  # [0, 1, 2], 10 tokens computed
    run_prompt(kv, b)  # [3, 4]
    for token in (50, 51):  # tokens 10 and 11 still land in block 2
        a.append_output_token(token)
        assert ids(kv.allocate_slots(a, 1)) == []
        compute(kv, a, 1)
    a.append_output_token(52)  # token 12 opens block 3 of A: the next free id, 5
    assert ids(kv.allocate_slots(a, 1)) == [5]
    assert kv.get_block_ids("a") == [0, 1, 2, 5]
    compute(kv, a, 1)
    assert kv.num_cached_blocks["a"] == 3  # block 2 filled up with outputs and got registered
    kv.check_integrity()


def test_prefix_hits_on_free_blocks_plus_new_blocks() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(12)))
    run_prompt(kv, a)  # [0, 1, 2], all three full and cached
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    b = make_sequence("b", [*range(12), 40, 41, 42, 43, 44])  # 17 tokens: 5 blocks
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1, 2] and num_hit_tokens == 12
    assert ids(kv.allocate_slots(b, 5, hits)) == [3, 4]
    assert kv.get_block_ids("b") == [0, 1, 2, 3, 4]
    assert [blk.ref_count for blk in kv.seq_to_blocks["b"]] == [1, 1, 1, 1, 1]
    # The hits left the middle/tail of the queue; the new blocks came from the head.
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9]
    assert kv.num_cached_blocks["b"] == 3  # hits are registered already; new blocks start at 3
    assert kv.pool.num_evictions == 0
    kv.check_integrity()


def test_prefix_hits_on_held_blocks_are_shared() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(10)))
    run_prompt(kv, a)  # [0, 1, 2]
    b = make_sequence("b", [*range(8), 77, 78])
    admit(kv, b)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_count for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert b.num_computed_tokens == 8
    kv.check_integrity()

    kv.free(a)  # the shared prefix stays with B; only A's own block is freed
    assert [blk.ref_count for blk in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2]
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    kv.check_integrity()


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    kv = make_kv(num_blocks=4)
    a = make_sequence("a", list(range(10)))
    run_prompt(kv, a)  # 3 of 4 blocks
    before = snapshot(kv)
    b = make_sequence("b", list(range(100, 108)))  # needs 2 blocks, 1 free
    assert kv.allocate_slots(b, 8) is None
    assert snapshot(kv) == before
    assert "b" not in kv.seq_to_blocks and "b" not in kv.num_cached_blocks
    # The one free block is still usable.
    assert ids(kv.allocate_slots(b, 4)) == [3]
    kv.check_integrity()


def test_growth_fails_cleanly_when_the_pool_is_empty() -> None:
    kv = make_kv(num_blocks=3)
    a = make_sequence("a", list(range(12)))
    run_prompt(kv, a)  # all three blocks
    a.append_output_token(5)
    before = snapshot(kv)
    assert kv.allocate_slots(a, 1) is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("a") == [0, 1, 2]


def _cache_then_free_two_blocks(kv: KVCacheManager) -> None:
    """Leaves blocks 0 and 1 free but cached for the prefix range(8); every block is free."""
    a = make_sequence("a", list(range(8)))
    admit(kv, a)
    compute(kv, a, 8)
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks and len(kv.pool.cached_blocks) == 2


def test_hits_on_free_blocks_consume_free_capacity() -> None:
    kv = make_kv(num_blocks=4)
    _cache_then_free_two_blocks(kv)
    # 17 tokens = 5 blocks: 2 hits + 3 new. 4 blocks are free, but 2 of them *are* the hits.
    b = make_sequence("b", [*range(8), *range(50, 59)])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and num_hit_tokens == 8
    before = snapshot(kv)
    assert kv.allocate_slots(b, 9, hits) is None
    assert snapshot(kv) == before  # the hits were not touched, nothing evicted
    assert all(blk.ref_count == 0 and blk.is_queued for blk in hits)
    kv.check_integrity()


def test_hits_on_free_blocks_exactly_fill_the_pool() -> None:
    kv = make_kv(num_blocks=4)
    _cache_then_free_two_blocks(kv)
    b = make_sequence("b", [*range(8), *range(50, 58)])  # 16 tokens = 2 hits + 2 new blocks
    hits, _ = kv.get_computed_blocks(b)
    assert ids(kv.allocate_slots(b, 8, hits)) == [2, 3]
    assert kv.get_block_ids("b") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 0
    assert kv.pool.num_evictions == 0  # the hits were pulled out before the new blocks were taken
    kv.check_integrity()


# --------------------------------------------------------------------------- cache_computed_blocks
def test_only_full_computed_blocks_are_registered() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(14)))
    kv.allocate_slots(a, 6)  # chunk 1: tokens [0, 6) -> blocks [0, 1]
    compute(kv, a, 6)
    assert kv.pool.blocks[0].block_hash == a.block_hashes[0]
    assert kv.pool.blocks[1].block_hash is None  # allocated, half computed: not a prefix yet
    assert kv.num_cached_blocks["a"] == 1
    assert list(kv.pool.cached_blocks.values()) == [kv.pool.blocks[0]]

    kv.allocate_slots(a, 5)  # chunk 2: tokens [6, 11) -> block 2
    compute(kv, a, 5)
    assert kv.num_cached_blocks["a"] == 2
    assert kv.pool.blocks[1].block_hash == a.block_hashes[1]
    assert kv.pool.blocks[2].block_hash is None  # its tokens exist in the prompt but are not computed

    kv.allocate_slots(a, 3)  # the rest: tokens [11, 14)
    compute(kv, a, 3)
    assert kv.num_cached_blocks["a"] == 3
    assert kv.pool.blocks[2].block_hash == a.block_hashes[2]
    assert kv.pool.blocks[3].block_hash is None  # tokens 12, 13: partial
    assert [kv.pool.cached_blocks[x] for x in a.block_hashes[:3]] == kv.seq_to_blocks["a"][:3]
    kv.check_integrity()


def test_registration_is_idempotent() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(9)))
    run_prompt(kv, a)
    cached = dict(kv.pool.cached_blocks)
    kv.cache_computed_blocks(a)
    kv.cache_computed_blocks(a)
    assert kv.pool.cached_blocks == cached
    assert kv.num_cached_blocks["a"] == 2


def test_same_prefix_computed_twice_keeps_the_first_blocks_in_the_map() -> None:
    kv = make_kv()
    a, b = make_sequence("a", list(range(9))), make_sequence("b", list(range(9)))
    admit(kv, a)  # both looked up before either is computed: no hits
    admit(kv, b)
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.get_block_ids("b") == [3, 4, 5]
    compute(kv, a, 9)
    compute(kv, b, 9)
    assert [kv.pool.cached_blocks[x].block_id for x in a.block_hashes] == [0, 1]
    c = make_sequence("c", list(range(9)))
    hits, _ = kv.get_computed_blocks(c)
    assert ids(hits) == [0, 1]
    kv.check_integrity()


def test_no_registration_when_caching_disabled() -> None:
    kv = make_kv(caching=False)
    a = make_sequence("a", list(range(12)))
    run_prompt(kv, a)
    assert kv.pool.cached_blocks == {}
    assert all(blk.block_hash is None for blk in kv.pool.blocks)


# ---------------------------------------------------------------------------------- free, reset
def test_free_returns_every_block_last_first() -> None:
    kv = make_kv(num_blocks=6)
    a = make_sequence("a", list(range(10)))
    run_prompt(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert kv.seq_to_blocks == {} and kv.num_cached_blocks == {}
    assert kv.usage == 0.0
    kv.free(a)  # freeing a sequence that holds nothing is a no-op
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_reset_prefix_cache_drops_all_hits() -> None:
    kv = make_kv()
    a = make_sequence("a", list(range(9)))
    run_prompt(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_sequence("b", list(range(9)))) == ([], 0)
    # A sequence still holding blocks keeps them, and does not re-register the (suspect) KV later.
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_cached_blocks["a"] == 3
    for token in (60, 61, 62):  # fill block 2 with outputs and compute them
        a.append_output_token(token)
    compute(kv, a, 3)
    assert kv.pool.cached_blocks == {}
    kv.check_integrity()


# ------------------------------------------------------------------------------------- integrity
def test_check_integrity_passes_and_detects_corruption() -> None:
    kv = make_kv()
    a, b = make_sequence("a", list(range(10))), make_sequence("b", list(range(9)))
    run_prompt(kv, a)
    admit(kv, b)  # shares blocks 0 and 1 with A
    kv.check_integrity()

    kv.pool.blocks[0].ref_count += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="holders"):
        kv.check_integrity()
    kv.pool.blocks[0].ref_count -= 1
    kv.check_integrity()

    kv.seq_to_blocks["b"].append(kv.seq_to_blocks["b"][0])  # a block twice in one table
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.seq_to_blocks["b"].pop()

    kv.num_cached_blocks["ghost"] = 0  # a counter for a sequence that holds nothing
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity()
    del kv.num_cached_blocks["ghost"]
    kv.check_integrity()


def test_num_blocks_for_tokens_rounds_up() -> None:
    kv = make_kv()
    assert [kv.num_blocks_for_tokens(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
