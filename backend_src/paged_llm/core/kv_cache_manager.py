"""Request -> KV blocks: prefix-cache lookups, slot allocation, freeing. Pure Python (no torch).

Block i of a request holds the KV of tokens [i * block_size, (i + 1) * block_size). A full block's
hash chains its parent's hash with its own token ids (and a salt naming the model), so equal hashes
mean equal prefixes, not merely equal blocks:

    tokens:  [t0 .. t15][t16 .. t31][t32 t33]
    hashes:  h0 = H(salt, -, t0..15)   h1 = H(salt, h0, t16..31)    (partial block: no hash)
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from paged_llm.core.block_pool import BlockHash, BlockPool, KVBlock
from paged_llm.request import Request


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    digest = hashlib.blake2b(digest_size=16, key=salt[:64])
    digest.update(parent or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


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
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as plain ids, kept in step with req_to_blocks: the scheduler hands these
        # lists to the runner every step, so they must not be rebuilt per step.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
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

    def update_block_hashes(self, request: Request) -> None:
        """Extends `request.block_hashes` to every full block of its current tokens."""
        size = self.block_size_tokens
        num_full_blocks = request.num_tokens // size
        hashes = request.block_hashes
        while len(hashes) < num_full_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[index * size : (index + 1) * size]
            hashes.append(hash_block_tokens(parent, tokens, self.hash_salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request that has no KV yet, as (blocks, num_tokens).

        At most `num_tokens - 1` tokens are served from the cache: the last token is always computed,
        because its forward pass produces the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        assert request.request_id not in self.req_to_blocks, "lookup for a request that holds blocks"
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size_tokens
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size_tokens
        self.num_prefix_queried_tokens += request.num_tokens
        self.num_prefix_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed (and newly hit) ones.

        Returns the newly allocated blocks, or None (and changes nothing) when the pool is short.
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_hit_tokens = len(new_computed_blocks) * self.block_size_tokens
        num_needed_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        if not new_computed_blocks and blocks and len(blocks) * self.block_size_tokens >= num_needed_tokens:
            return []  # the common decode step: the last block still has room
        num_new_blocks = (
            self.num_blocks_for_tokens(num_needed_tokens) - len(blocks) - len(new_computed_blocks)
        )
        # Hits on free blocks leave the free queue, so they count against what can be allocated.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if max(num_new_blocks, 0) > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        added = [*new_computed_blocks, *new_blocks]
        if request.request_id in self.req_to_blocks:
            blocks.extend(added)
            self.req_to_block_ids[request.request_id].extend(block.block_id for block in added)
        else:
            self.req_to_blocks[request.request_id] = added
            self.req_to_block_ids[request.request_id] = [block.block_id for block in added]
        self.num_cached_blocks.setdefault(request.request_id, 0)
        self.num_cached_blocks[request.request_id] += len(new_computed_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the request's full blocks whose KV is now computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full_blocks = min(request.num_computed_tokens // self.block_size_tokens, len(blocks))
        first = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= first:
            return
        self.update_block_hashes(request)
        for index in range(first, num_full_blocks):
            self.pool.cache_block(blocks[index], request.block_hashes[index])
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_to_block_ids.get(request_id, ()))

    def block_ids_view(self, request_id: str) -> list[int]:
        """The request's live block table (no copy): it grows as blocks are added; read it, never
        change it, and do not keep it past the next allocation."""
        return self.req_to_block_ids[request_id]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        for request_id in self.num_cached_blocks:
            self.num_cached_blocks[request_id] = len(self.req_to_blocks.get(request_id, []))

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_count equals the number of requests holding it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"{block} has ref_count {block.ref_count} but {holders.get(block.block_id, 0)} holders"
            )
        assert set(self.num_cached_blocks) == set(self.req_to_blocks), "cached-block counters leaked"
        for request_id, blocks in self.req_to_blocks.items():
            assert self.req_to_block_ids[request_id] == [b.block_id for b in blocks], "id table out of sync"
        assert set(self.req_to_block_ids) == set(self.req_to_blocks), "id tables leaked"
