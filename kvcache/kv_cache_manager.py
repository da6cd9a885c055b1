"""Block tables of the sequences on one KV pool, with prefix caching and forks.

The scheduler calls this to find cached prefixes, to grow a sequence's table before
a step, to fork ``n > 1`` children and to free. Full blocks are registered in the
prefix cache as soon as the tokens filling them are scheduled: within one step every
layer writes all new KV before any attention reads it, so a block cached by one
sequence can be read by another in the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block_hash import BlockHash, extend_block_hashes
from kvcache.block_pool import BlockPool


@dataclass
class SeqBlocks:
    block_ids: list[int] = field(default_factory=list)  # -1: the block's KV is elsewhere
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached: int = 0  # leading blocks already registered in the prefix cache
    extra_ids: list[int] = field(default_factory=list)  # blocks outside the table (recall)


@dataclass
class PrefixHit:
    block_ids: list[int]
    num_tokens: int


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()
        self._seqs: dict[str, SeqBlocks] = {}

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_ids(self, seq_id: str) -> list[int]:
        s = self._seqs.get(seq_id)
        return s.block_ids if s else []

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int]) -> PrefixHit:
        """Cached leading blocks of ``token_ids``, leaving at least one token to compute
        (its logits are needed to sample)."""
        if not self.enable_caching:
            return PrefixHit([], 0)
        hashes = self._entry(seq_id).hashes
        extend_block_hashes(hashes, token_ids, self.block_size)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit = self.pool.lookup(hashes[:max_blocks])
        return PrefixHit(hit, len(hit) * self.block_size)

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int,
                 num_computed_tokens: int, prefix: PrefixHit | None = None) -> list[int] | None:
        """Grow the table to hold ``num_computed + num_new`` tokens.

        ``prefix``: a fresh sequence's cache lookup, whose blocks are shared first. The
        caller records it in ``stats`` once the sequence is admitted, which may still
        fail after this. Returns the block ids appended to the table (prefix hits
        first), or None when the pool is short, in which case nothing changed.
        """
        entry = self._entry(seq_id)
        hit = prefix.block_ids if prefix else []
        have = len(entry.block_ids) + len(hit)
        need = self.num_blocks_needed(num_computed_tokens + num_new_tokens) - have
        # Evictable cached blocks that this sequence is about to reuse do not count as
        # free for its own allocation.
        reusable = sum(1 for b in hit if self.pool.ref_count(b) == 0)
        if need > self.pool.num_free_blocks - reusable:
            return None
        self.pool.share(hit)
        fresh = self.pool.allocate(max(need, 0)) or []
        added = hit + fresh
        entry.block_ids.extend(added)
        self._cache_full_blocks(entry, token_ids, num_computed_tokens + num_new_tokens)
        return added

    def reserve(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                skip: tuple[int, int] | None = None,
                arriving: tuple[int, list[int]] | None = None
                ) -> tuple[list[int], list[int]] | None:
        """Blocks for a sequence whose first ``num_tokens`` tokens of KV come from another
        pool: (leading blocks this pool already holds, fresh blocks to receive the rest,
        in order). The fresh blocks enter the prefix cache only at ``commit``, once their
        KV has arrived. ``skip`` (first, end): table indices whose KV goes to another
        tier instead; they get -1 and no block (a prefix hit stops before them).
        ``arriving`` (first, block ids): blocks another transfer is still filling with
        the sequence's blocks from table index ``first`` on (a prefix push); when the
        cached prefix ends there, they are shared rather than reserved again, and the
        caller must not commit before that transfer has. None when the pool is short
        (nothing changed). The caller records the hit in ``stats``: only it knows which
        cached blocks came for this sequence.
        """
        first, end = skip or (0, 0)
        hit = self.find_cached_prefix(seq_id, token_ids[:num_tokens + 1])
        hit_ids = hit.block_ids[:first] if skip else hit.block_ids
        registered = len(hit_ids)
        if arriving is not None and arriving[0] == registered and skip is None:
            hit_ids = hit_ids + arriving[1][:self.num_blocks_needed(num_tokens) - registered]
        need = self.num_blocks_needed(num_tokens) - len(hit_ids) - (end - first)
        reusable = sum(1 for b in hit_ids if self.pool.ref_count(b) == 0)
        if need > self.pool.num_free_blocks - reusable:
            self._seqs.pop(seq_id, None)
            return None
        self.pool.share(hit_ids)
        fresh = self.pool.allocate(need) or []
        entry = self._entry(seq_id)
        before = first - len(hit_ids) if skip else len(fresh)
        entry.block_ids = hit_ids + fresh[:before] + [-1] * (end - first) + fresh[before:]
        entry.num_cached = registered
        return hit_ids, fresh

    def commit(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Register the full blocks of a ``reserve``d sequence, now that their KV is here."""
        self._cache_full_blocks(self._seqs[seq_id], token_ids, num_tokens)

    def block_hashes(self, seq_id: str) -> list[BlockHash]:
        """Chained hashes of the sequence's full blocks known so far."""
        s = self._seqs.get(seq_id)
        return list(s.hashes) if s else []

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Give ``child_id`` the parent's first ``num_tokens`` tokens of KV.

        Full blocks are shared; a partial last block is copied into a fresh block.
        Returns (copy_src, copy_dst), (-1, -1) when nothing needs copying, or None if
        the pool has no block for the copy (nothing changed).
        """
        parent = self._seqs[parent_id]
        n_blocks = self.num_blocks_needed(num_tokens)
        n_full = num_tokens // self.block_size
        copy: tuple[int, int] = (-1, -1)
        tail: list[int] = []
        if n_blocks > n_full:
            fresh = self.pool.allocate(1)
            if fresh is None:
                return None
            tail = fresh
            copy = (parent.block_ids[n_full], fresh[0])
        shared = parent.block_ids[:n_full]
        self.pool.share(shared)
        self._seqs[child_id] = SeqBlocks(
            block_ids=shared + tail, hashes=list(parent.hashes[:n_full]),
            num_cached=min(parent.num_cached, n_full))
        return copy

    def release(self, seq_id: str, first: int, count: int) -> list[int]:
        """Free ``count`` table blocks from index ``first`` on, whose KV moves to another
        tier; their table entries become -1. Returns the freed block ids, in order."""
        entry = self._seqs[seq_id]
        ids = entry.block_ids[first:first + count]
        if len(ids) != count or min(ids, default=0) < 0:
            raise ValueError(f"sequence {seq_id!r}: blocks {first}..{first + count - 1} are "
                             "not all in this pool")
        self.pool.free(reversed(ids))
        entry.block_ids[first:first + count] = [-1] * count
        return ids

    def allocate_extra(self, seq_id: str, n: int) -> list[int] | None:
        """``n`` blocks held by the sequence outside its table (a recall cache), freed with
        it; None when the pool is short (nothing changed)."""
        ids = self.pool.allocate(n)
        if ids is not None:
            self._entry(seq_id).extra_ids.extend(ids)
        return ids

    def num_held_blocks(self, seq_id: str) -> int:
        s = self._seqs.get(seq_id)
        return sum(b >= 0 for b in s.block_ids) + len(s.extra_ids) if s else 0

    def free(self, seq_id: str) -> None:
        entry = self._seqs.pop(seq_id, None)
        if entry is not None:
            self._free_blocks(entry)

    def reset(self, seq_id: str) -> None:
        """Free a preempted sequence's blocks but keep its hashes for the cache lookup."""
        entry = self._seqs.get(seq_id)
        if entry is not None:
            self._free_blocks(entry)
            entry.block_ids = []
            entry.extra_ids = []
            entry.num_cached = 0

    def _free_blocks(self, entry: SeqBlocks) -> None:
        self.pool.free(reversed(entry.extra_ids))
        self.pool.free(b for b in reversed(entry.block_ids) if b >= 0)

    def _entry(self, seq_id: str) -> SeqBlocks:
        entry = self._seqs.get(seq_id)
        if entry is None:
            entry = self._seqs[seq_id] = SeqBlocks()
        return entry

    def _cache_full_blocks(self, entry: SeqBlocks, token_ids: Sequence[int],
                           num_tokens: int) -> None:
        if not self.enable_caching:
            return
        n_full = min(num_tokens, len(token_ids)) // self.block_size
        if n_full <= entry.num_cached:
            return
        extend_block_hashes(entry.hashes, token_ids[:n_full * self.block_size], self.block_size)
        for i in range(entry.num_cached, n_full):
            if entry.block_ids[i] >= 0:
                self.pool.cache(entry.block_ids[i], entry.hashes[i])
        entry.num_cached = n_full
