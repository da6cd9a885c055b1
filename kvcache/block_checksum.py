"""Per-block checksums: XXH3-64 of a block's bytes in KV-batch row order (layer, K/V).

That order is the row of the Arrow KV batch, so a checksum taken over a pool's slabs in
place equals one taken over a contiguous row. XXH3 ran at 19-28 GB/s per core here,
twice CRC32C (``crc32c``, hardware CRC instructions), so the receiver can hash each block
right after copying it, while it is still in cache, for a fraction of the copy's time.
It guards against corruption and stale memory, not forgery: the peers trust each other.

A pool's bytes are read as ``(layers * 2, num_blocks, slab_bytes)``: slab ``k`` of block
``b`` is layer ``k // 2``'s K (even) or V (odd) of that block, one contiguous run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

_COPY_THREADS = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                   thread_name_prefix="kv-copy")


def block_checksum(slabs: np.ndarray, block: int) -> int:
    """The checksum of ``block`` of a ``(layers * 2, num_blocks, slab_bytes)`` byte view."""
    h = xxhash.xxh3_64()
    for slab in slabs[:, block]:
        h.update(slab)
    return h.intdigest()


def block_checksums(slabs: np.ndarray, blocks: Sequence[int]) -> np.ndarray:
    """The checksums of ``blocks`` (uint64), in order."""
    return np.fromiter((block_checksum(slabs, b) for b in blocks), dtype=np.uint64,
                       count=len(blocks))


def copy_verified(src: np.ndarray, src_blocks: Sequence[int], dst: np.ndarray,
                  dst_blocks: Sequence[int], checksums: np.ndarray,
                  threads: int = 1) -> int | None:
    """Copy each source block to its destination block and hash the copy while it is in
    cache; returns the index of a block whose copy does not match its checksum (the
    copying stops soon after it), else None.

    ``threads`` threads take a share of the blocks each: numpy copies without the GIL,
    and a block's copy (12 KB runs, one per layer and K/V) is latency-bound, so two of
    them nearly double the rate; the in-cache hash, which holds the GIL, is short beside
    it. ``dst`` may be left holding part of the copy whatever the outcome.
    """
    n = len(src_blocks)
    bad: list[int] = []
    stop = threading.Event()

    def share(first: int, end: int) -> None:
        for i in range(first, end):
            if stop.is_set():
                return
            d = dst_blocks[i]
            dst[:, d] = src[:, src_blocks[i]]
            if block_checksum(dst, d) != checksums[i]:
                bad.append(i)
                stop.set()
                return

    k = max(1, min(threads, n))
    cuts = [n * i // k for i in range(k + 1)]
    helpers = [_COPY_THREADS.submit(share, a, b) for a, b in zip(cuts[1:-1], cuts[2:])]
    share(cuts[0], cuts[1])
    for h in helpers:
        h.result()
    return min(bad) if bad else None


def row_checksums(rows: np.ndarray) -> np.ndarray:
    """The checksums of contiguous rows ``(n, row_bytes)`` (uint8), such as a KV batch's."""
    return np.fromiter((xxhash.xxh3_64_intdigest(r) for r in rows), dtype=np.uint64,
                       count=len(rows))


class BlockChecksums:
    """Each block's checksum, taken when the block is written, so that a handoff sends
    stored checksums instead of reading its blocks once more before the copy.

    The one rule: every write into a block tells this store, through ``written`` (the
    checksum is gone), ``written_slots`` (a step's writes: the blocks whose last slot was
    written are full and hashed now, the others' checksums are gone), ``stored`` (the
    writer knows the new bytes' checksum: a verified copy's) or ``copied`` (a block copied
    whole from another). ``of`` gives the stored checksums and hashes the blocks that
    have none, so a missing checksum costs a hash at export, never a wrong one. A write
    that skipped this store leaves a stale checksum, which the receiver's verification
    refuses: the sequence is recomputed, no block is trusted on it.
    """

    def __init__(self, slabs: np.ndarray) -> None:
        """``slabs``: the pool's ``(layers * 2, num_blocks, slab_bytes)`` byte view."""
        self._slabs = slabs
        self._sums = np.zeros(slabs.shape[1], dtype=np.uint64)
        self._valid = np.zeros(slabs.shape[1], dtype=bool)

    def written(self, blocks: Sequence[int] | np.ndarray) -> None:
        self._valid[np.asarray(blocks, dtype=np.int64)] = False

    def written_slots(self, slots: np.ndarray, block_size: int) -> None:
        """A step wrote ``slots`` (``block * block_size + offset``); the blocks it filled
        (their last slot among them) are hashed now, in the step, off any handoff's path."""
        blocks = np.unique(slots // block_size)
        self.written(blocks)
        full = np.unique(slots[slots % block_size == block_size - 1] // block_size)
        self.seal(full)

    def seal(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Hash ``blocks`` as they are now and store their checksums."""
        ids = np.asarray(blocks, dtype=np.int64)
        self._sums[ids] = block_checksums(self._slabs, ids)
        self._valid[ids] = True

    def stored(self, blocks: Sequence[int] | np.ndarray, checksums: np.ndarray) -> None:
        """``blocks`` now hold bytes whose checksums are known (verified while copied)."""
        ids = np.asarray(blocks, dtype=np.int64)
        self._sums[ids] = checksums
        self._valid[ids] = True

    def copied(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Blocks ``dst`` were overwritten whole with blocks ``src`` (a fork's copy)."""
        s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        self._sums[d] = self._sums[s]
        self._valid[d] = self._valid[s]

    def has(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """Which of ``blocks`` have a stored checksum (bool per block)."""
        return self._valid[np.asarray(blocks, dtype=np.int64)]

    def of(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """The checksums of ``blocks`` (uint64), hashing now those with none stored."""
        ids = np.asarray(blocks, dtype=np.int64)
        missing = ids[~self._valid[ids]]
        if missing.size:
            self.seal(missing)
        return self._sums[ids]
