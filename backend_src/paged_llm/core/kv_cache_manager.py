"""Sequence -> KV blocks: prefix-cache lookups, slot allocation, freeing. Pure Python (no torch).

Block i of a sequence holds the KV of tokens [i * block_size, (i + 1) * block_size). A full block's
hash chains its parent's hash with its own token ids (and a salt naming the model; the chain's root
names the request's LoRA adapter, if any), so equal hashes mean equal prefixes, not merely equal
blocks:

    tokens:  [t0 .. t15][t16 .. t31][t32 t33]
    hashes:  h0 = H(salt, -, t0..15)   h1 = H(salt, h0, t16..31)    (partial block: no hash)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import abc

from paged_llm.core.block_pool import BlockHash, BlockPool, KVBlock
from paged_llm.sequence import Sequence


def hash_block_tokens(
    parent: BlockHash | None, token_ids: abc.Sequence[int], salt: bytes, root: bytes = b"root"
) -> BlockHash:
    """A block's hash; `parent` None: the first block, chained to `root` (Sequence.hash_root)."""
    return _hash_block_bytes(parent or root, array("q", token_ids).tobytes(), salt[:64])


def _hash_block_bytes(parent: bytes, token_bytes: bytes | memoryview, key: bytes) -> BlockHash:
    return hashlib.blake2b(parent + token_bytes, digest_size=16, key=key).digest()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size_tokens: int,
        enable_prefix_caching: bool = True,
        hash_salt: bytes = b"",
    ) -> None:
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.seq_to_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as plain ids, kept in step with seq_to_blocks: the scheduler hands these
        # lists to the runner every step, so they must not be rebuilt per step.
        self.seq_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each sequence are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size_tokens)

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extends `seq.block_hashes` to every full block of its known tokens (not pending ones)."""
        size = self.block_size_tokens
        num_full_blocks = seq.num_known_tokens // size
        hashes = seq.block_hashes
        first = len(hashes)
        if first >= num_full_blocks:
            return
        # The same digests as hash_block_tokens, block by block, from one conversion of all the new
        # blocks' tokens: admitting a 16k-token step hashes ~1,000 blocks on the engine's hot path.
        tokens = array("q", seq.all_token_ids[first * size : num_full_blocks * size])
        token_bytes = memoryview(tokens.tobytes())
        stride = size * tokens.itemsize
        key = self.hash_salt[:64]
        parent = hashes[-1] if hashes else seq.hash_root
        for offset in range(0, len(token_bytes), stride):
            parent = _hash_block_bytes(parent, token_bytes[offset : offset + stride], key)
            hashes.append(parent)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a sequence that has no KV yet, as (blocks, num_tokens).

        At most `num_tokens - 1` tokens are served from the cache: the last token is always computed,
        because its forward pass produces the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        assert seq.seq_id not in self.seq_to_blocks, "lookup for a seq that holds blocks"
        self.update_block_hashes(seq)
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size_tokens
        hits: list[KVBlock] = []
        for block_hash in seq.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: abc.Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed (and newly hit) ones.

        Returns the newly allocated blocks, or None (and changes nothing) when the pool is short.
        The first successful allocation of a sequence is its admission: that is when its prefix
        lookup counts in the hit statistics (a head-of-line sequence retried step after step while
        the pool is short counts once, when it finally gets in).
        """
        blocks = self.seq_to_blocks.get(seq.seq_id, [])
        num_hit_tokens = len(new_computed_blocks) * self.block_size_tokens
        num_needed_tokens = seq.num_computed_tokens + num_hit_tokens + num_new_tokens
        if not new_computed_blocks and blocks and len(blocks) * self.block_size_tokens >= num_needed_tokens:
            return []  # the common decode step: the last block still has room
        num_new_blocks = (
            self.num_blocks_for_tokens(num_needed_tokens) - len(blocks) - len(new_computed_blocks)
        )
        # Hits on free blocks leave the free queue, so they count against what can be allocated.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if max(num_new_blocks, 0) > self.pool.num_free_blocks - num_free_hits:
            return None
        if self.enable_prefix_caching and seq.seq_id not in self.seq_to_blocks:
            self.num_prefix_queried_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += num_hit_tokens
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        added = [*new_computed_blocks, *new_blocks]
        if seq.seq_id in self.seq_to_blocks:
            blocks.extend(added)
            self.seq_to_block_ids[seq.seq_id].extend(block.block_id for block in added)
        else:
            self.seq_to_blocks[seq.seq_id] = added
            self.seq_to_block_ids[seq.seq_id] = [block.block_id for block in added]
        self.num_cached_blocks.setdefault(seq.seq_id, 0)
        self.num_cached_blocks[seq.seq_id] += len(new_computed_blocks)
        return new_blocks

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's full blocks whose KV is now computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.seq_to_blocks.get(seq.seq_id)
        if not blocks:
            return
        num_computed_known = min(seq.num_computed_tokens, seq.num_known_tokens)
        num_full_blocks = min(num_computed_known // self.block_size_tokens, len(blocks))
        first = self.num_cached_blocks.get(seq.seq_id, 0)
        if num_full_blocks <= first:
            return
        self.update_block_hashes(seq)
        for index in range(first, num_full_blocks):
            self.pool.cache_block(blocks[index], seq.block_hashes[index])
        self.num_cached_blocks[seq.seq_id] = num_full_blocks

    def free(self, seq: Sequence) -> None:
        self.free_owner(seq.seq_id)

    def hand_over(self, from_owner: str, to_owner: str) -> None:
        """Moves a block table to another owner, unchanged (a session keeps a finished turn's blocks
        and gives them to its next turn: core/sessions.py). Owners are sequence ids or holder keys."""
        assert to_owner not in self.seq_to_blocks, f"{to_owner!r} already holds blocks"
        self.seq_to_blocks[to_owner] = self.seq_to_blocks.pop(from_owner)
        self.seq_to_block_ids[to_owner] = self.seq_to_block_ids.pop(from_owner)
        self.num_cached_blocks[to_owner] = self.num_cached_blocks.pop(from_owner)

    def free_owner(self, owner: str) -> int:
        """Frees whatever `owner` holds (a holder key); returns how many blocks it held."""
        blocks = self.seq_to_blocks.pop(owner, [])
        self.seq_to_block_ids.pop(owner, None)
        self.num_cached_blocks.pop(owner, None)
        self.pool.free(reversed(blocks))
        return len(blocks)

    def truncate(self, owner: str, num_tokens: int) -> int:
        """Keeps `owner`'s blocks for its first `num_tokens` tokens and frees the rest (a sequence
        cut short: core/scheduler.py truncate_output). A kept block that the prefix cache holds for
        longer contents is freed too, since whoever takes these blocks next writes into the last one.
        Returns how many tokens the kept blocks can hold KV for (num_tokens, or down to a block
        boundary)."""
        size = self.block_size_tokens
        blocks = self.seq_to_blocks[owner]
        num_kept_blocks = self.num_blocks_for_tokens(num_tokens)
        num_usable_tokens = num_tokens
        if num_tokens % size and num_kept_blocks <= self.num_cached_blocks[owner]:
            num_kept_blocks -= 1  # its hash says more tokens than it keeps: never write into it
            num_usable_tokens = num_kept_blocks * size
        if num_kept_blocks == 0:  # nothing left: the owner holds nothing (not an empty table)
            self.free_owner(owner)
            return 0
        dropped = blocks[num_kept_blocks:]
        del blocks[num_kept_blocks:]
        del self.seq_to_block_ids[owner][num_kept_blocks:]
        self.num_cached_blocks[owner] = min(self.num_cached_blocks[owner], num_kept_blocks)
        self.pool.free(reversed(dropped))
        return num_usable_tokens

    def holds(self, owner: str) -> bool:
        return owner in self.seq_to_blocks

    def get_block_ids(self, seq_id: str) -> list[int]:
        return list(self.seq_to_block_ids.get(seq_id, ()))

    def block_ids_view(self, seq_id: str) -> list[int]:
        """The sequence's live block table (no copy): it grows as blocks are added; read it, never
        change it, and do not keep it past the next allocation."""
        return self.seq_to_block_ids[seq_id]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        for seq_id in self.num_cached_blocks:
            self.num_cached_blocks[seq_id] = len(self.seq_to_blocks.get(seq_id, []))

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_count equals the number of sequences holding it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for blocks in self.seq_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "a seq holds a block twice"
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"{block} has ref_count {block.ref_count} but {holders.get(block.block_id, 0)} holders"
            )
        assert set(self.num_cached_blocks) == set(self.seq_to_blocks), "cached-block counters leaked"
        for seq_id, blocks in self.seq_to_blocks.items():
            assert self.seq_to_block_ids[seq_id] == [b.block_id for b in blocks], "id table out of sync"
        assert set(self.seq_to_block_ids) == set(self.seq_to_blocks), "id tables leaked"
