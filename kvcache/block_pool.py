"""Metadata of one paged KV pool: reference counts, the free list, the prefix cache.

Every structure is preallocated per block, so allocate, free, share and cache-hit
are O(1) per block with no per-call allocation beyond the returned list. Free
blocks sit in one intrusive doubly linked list in LRU order: blocks whose contents
are cached (hashed) wait at the tail so they survive as long as possible, plain
free blocks go to the head and are reused first. Allocation pops the head and
evicts the popped block's hash, if any. The pool holds no tensors: the scheduler
owns this bookkeeping, the worker owns the KV memory it describes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcache.block_hash import BlockHash


class BlockPoolError(RuntimeError):
    """A block operation that would corrupt the pool (double free, foreign id)."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: got {num_blocks}; need at least 1 block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        # Sentinel node num_blocks closes the ring; all blocks start free.
        s = num_blocks
        self._next = list(range(1, num_blocks + 1)) + [0]
        self._prev = [s] + list(range(num_blocks))
        self._num_free = num_blocks

    # ---- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (evictable cached blocks included)."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list from head (next to be allocated) to tail; for tests and stats."""
        out, b = [], self._next[self.num_blocks]
        while b != self.num_blocks:
            out.append(b)
            b = self._next[b]
        return out

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids holding the longest cached prefix of ``hashes`` (refs unchanged)."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    # ---- mutations ---------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with ref count 1, or None (and no change) if too few."""
        if n > self._num_free:
            return None
        out = []
        for _ in range(n):
            b = self._next[self.num_blocks]
            self._unlink(b)
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference (fork, or a prefix-cache hit) on each block."""
        for b in block_ids:
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    raise BlockPoolError(f"block {b} is free and uncached; cannot share it")
                self._unlink(b)
            self._ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; a block reaching zero joins the free list.

        Callers pass a sequence's blocks last-first, so its tail is evicted before
        its (more shareable) head.
        """
        s = self.num_blocks
        for b in block_ids:
            r = self._ref[b]
            if r <= 0:
                raise BlockPoolError(f"block {b} freed more often than it was referenced")
            self._ref[b] = r - 1
            if r == 1:
                if self._hash[b] is None:
                    self._link_after(s, b)
                else:
                    self._link_after(self._prev[s], b)
                self._num_free += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a full, computed block under its chained hash."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # same content already cached in another block; keep that one
        if self._ref[block_id] == 0:
            raise BlockPoolError(f"block {block_id} is free; only held blocks can be cached")
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash

    def reset_prefix_cache(self) -> None:
        for b in self._cached.values():
            self._hash[b] = None
        self._cached.clear()

    # ---- linked list -------------------------------------------------------------
    def _unlink(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p] = n
        self._prev[n] = p
        self._num_free -= 1

    def _link_after(self, p: int, b: int) -> None:
        n = self._next[p]
        self._next[p] = b
        self._prev[b] = p
        self._next[b] = n
        self._prev[n] = b
