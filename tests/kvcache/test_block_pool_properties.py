"""Block pool invariants under any sequence of operations (hypothesis state machine).

A model of ownership is kept beside the pool: which holders own which blocks. After
every step: each block's ref count equals the number of holders that own it, no
count is negative, the free list holds exactly the unowned blocks (each once), free
plus used equals the total, and every cached hash maps to a block carrying it.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.block_hash import hash_block
from kvcache.block_pool import BlockPool, BlockPoolError
from kvcache.kv_cache_manager import KVCacheManager

NUM_BLOCKS = 12


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.holders: dict[int, list[int]] = {}
        self.next_holder = 0
        self.next_content = 0

    def _new_holder(self, blocks: list[int]) -> None:
        self.holders[self.next_holder] = blocks
        self.next_holder += 1

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free_before = self.pool.num_free_blocks
        got = self.pool.allocate(n)
        if n > free_before:
            assert got is None
            assert self.pool.num_free_blocks == free_before
        else:
            assert got is not None and len(got) == n and len(set(got)) == n
            assert all(self.pool.block_hash(b) is None for b in got), "evicted hash kept"
            self._new_holder(got)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), n=st.integers(1, 3))
    def append(self, data, n):
        h = data.draw(st.sampled_from(sorted(self.holders)))
        got = self.pool.allocate(n)
        if got is not None:
            self.holders[h] = self.holders[h] + got

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def fork(self, data):
        h = data.draw(st.sampled_from(sorted(self.holders)))
        blocks = list(self.holders[h])
        self.pool.share(blocks)
        self._new_holder(blocks)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        h = data.draw(st.sampled_from(sorted(self.holders)))
        self.pool.free(reversed(self.holders.pop(h)))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache(self, data):
        h = data.draw(st.sampled_from(sorted(self.holders)))
        if self.holders[h]:
            b = data.draw(st.sampled_from(self.holders[h]))
            self.pool.cache(b, hash_block(None, [self.next_content]))
            self.next_content += 1

    @rule(data=st.data())
    def cache_hit(self, data):
        cached = [(hsh, b) for b in range(NUM_BLOCKS)
                  if (hsh := self.pool.block_hash(b)) is not None]
        if not cached:
            return
        hsh, b = data.draw(st.sampled_from(cached))
        assert self.pool.lookup([hsh]) == [b]
        self.pool.share([b])
        self._new_holder([b])

    @rule()
    def double_free_is_refused(self):
        unowned = [b for b in range(NUM_BLOCKS) if self.pool.ref_count(b) == 0]
        if unowned:
            with pytest.raises(BlockPoolError):
                self.pool.free([unowned[0]])

    @invariant()
    def ownership_matches_ref_counts(self):
        owners = [0] * NUM_BLOCKS
        for blocks in self.holders.values():
            for b in blocks:
                owners[b] += 1
        for b in range(NUM_BLOCKS):
            assert self.pool.ref_count(b) == owners[b] >= 0

    @invariant()
    def free_list_is_exactly_the_unowned_blocks(self):
        free = self.pool.free_block_ids()
        assert len(free) == len(set(free)) == self.pool.num_free_blocks
        assert set(free) == {b for b in range(NUM_BLOCKS) if self.pool.ref_count(b) == 0}
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == NUM_BLOCKS

    @invariant()
    def cache_index_is_consistent(self):
        for b in range(NUM_BLOCKS):
            hsh = self.pool.block_hash(b)
            if hsh is not None:
                assert self.pool.lookup([hsh]) == [b]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                    derandomize=True)


def test_eviction_prefers_uncached_blocks_then_least_recently_freed():
    pool = BlockPool(4)
    a = pool.allocate(4)
    for i, b in enumerate(a[:2]):
        pool.cache(b, hash_block(None, [i]))
    pool.free([a[0]])       # cached, freed first -> evicted first among cached
    pool.free([a[1]])       # cached
    pool.free([a[2], a[3]])  # uncached -> reused before any cached block
    assert pool.allocate(2) == [a[3], a[2]]
    assert pool.num_cached_blocks == 2
    assert pool.allocate(1) == [a[0]]
    assert pool.num_cached_blocks == 1
    assert pool.lookup([hash_block(None, [1])]) == [a[1]]


def test_manager_prefix_hit_is_chained_and_leaves_one_token():
    kv = KVCacheManager(10, 16)
    tokens = list(range(48))
    assert kv.allocate("a", tokens, 48, 0) is not None
    hit = kv.find_cached_prefix("b", tokens)
    assert hit.num_tokens == 32  # the last full block is recomputed to get logits
    other = [99] + tokens[1:]
    assert kv.find_cached_prefix("c", other).num_tokens == 0  # chained: first block differs
    kv.free("a")
    assert kv.pool.num_used_blocks == 0
    assert kv.find_cached_prefix("b", tokens).num_tokens == 32  # survives as evictable
