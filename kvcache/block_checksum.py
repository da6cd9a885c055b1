"""Per-block checksums: CRC32C of a block's bytes in KV-batch row order (layer, K/V).

That order is the row of the Arrow KV batch, so a checksum taken over a pool's slabs in
place equals one taken over a contiguous row. The sender takes it with the ``crc32c``
package (hardware CRC instructions) when a block is written; the receiver takes it while
it copies, in one pass over each slab (``native_copy``: SSE4.2 CRC on the words it
moves), so verifying costs next to nothing beside the copy. It guards against
corruption and stale memory, not forgery: the peers trust each other. Checksums travel
as uint64 (the KV batch's column), holding the 32-bit CRC.

A pool's bytes are read as ``(layers * 2, num_blocks, slab_bytes)``: slab ``k`` of block
``b`` is layer ``k // 2``'s K (even) or V (odd) of that block, one contiguous run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np

from kvcache.native_copy import COPIED, native_copier
from kvcache.pool_rows import block_id_fault

_COPY_THREADS = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                   thread_name_prefix="kv-copy")


def block_checksum(slabs: np.ndarray, block: int) -> int:
    """The checksum of ``block`` of a ``(layers * 2, num_blocks, slab_bytes)`` byte view."""
    crc = 0
    for slab in slabs[:, block]:
        crc = crc32c.crc32c(slab, value=crc, gil_release_mode=1)
    return crc


def block_checksums(slabs: np.ndarray, blocks: Sequence[int]) -> np.ndarray:
    """The checksums of ``blocks`` (uint64), in order."""
    return np.fromiter((block_checksum(slabs, b) for b in blocks), dtype=np.uint64,
                       count=len(blocks))


class BlockIdError(ValueError):
    """Block ids a copy refused before moving any byte: outside their pool, or a
    destination named twice. ``side`` says which: ``source`` or ``destination``."""

    def __init__(self, side: str, detail: str) -> None:
        super().__init__(f"copy_verified {side} blocks: {detail}")
        self.side = side


def copy_verified(src: np.ndarray, src_blocks: Sequence[int], dst: np.ndarray,
                  dst_blocks: Sequence[int], checksums: np.ndarray,
                  threads: int = 1) -> int | None:
    """Copy each source block to its destination block, taking its checksum on the way;
    returns the index of a block whose copy does not match its checksum, else None.
    ``dst`` may then hold part of the copy. Ids outside their pool, or a destination
    named twice, raise ``BlockIdError`` before any byte moves.

    ``threads`` threads take a share of the blocks each. The native copy checks the ids,
    computes the CRC from the words it moves, without the GIL, on OpenMP's threads, in
    ascending source order, a slab of every block of its share before the next slab
    (near-sequential reads in a pool of 4 KB pages; a mismatch shows once its share is
    copied). Without it, numpy copies each block (no GIL) on a thread pool and the
    ``crc32c`` package hashes the copy while it is in cache, and a mismatch stops the
    copying soon after.
    """
    n = len(src_blocks)
    if src.shape[::2] != dst.shape[::2] or len(dst_blocks) != n or len(checksums) != n:
        raise ValueError(f"copy_verified: {n} source blocks of {src.shape}, {len(dst_blocks)} "
                         f"destination blocks of {dst.shape}, {len(checksums)} checksums; "
                         "expected one of each per block, slabs of one shape")
    src_ids = np.ascontiguousarray(src_blocks, dtype=np.int64)
    dst_ids = np.ascontiguousarray(dst_blocks, dtype=np.int64)
    expected = np.ascontiguousarray(checksums, dtype=np.uint64)
    native = native_copier()
    if native is not None:
        got = native.copy_blocks(src, src_ids, dst, dst_ids, expected, threads)
        if got < COPIED:   # refused: say why in numpy's words
            _check_ids(src_ids, src.shape[1], dst_ids, dst.shape[1])
            raise RuntimeError(f"copy_blocks refused ids ({got}) that _check_ids accepts")
        return None if got == COPIED else got
    _check_ids(src_ids, src.shape[1], dst_ids, dst.shape[1])
    stop = threading.Event()

    def share(first: int, end: int) -> int | None:
        for i in range(first, end):
            if stop.is_set():
                return None
            dst[:, dst_ids[i]] = src[:, src_ids[i]]
            if block_checksum(dst, dst_ids[i]) != expected[i]:
                stop.set()
                return i
        return None
    return _in_shares(share, n, threads)


def _in_shares(share: Callable[[int, int], int | None], n: int, threads: int) -> int | None:
    """``share`` over ``threads`` consecutive ranges of ``n`` rows, this thread taking
    the first; the least row any of them reports."""
    k = max(1, min(threads, n))
    cuts = [n * i // k for i in range(k + 1)]
    helpers = [_COPY_THREADS.submit(share, a, b) for a, b in zip(cuts[1:-1], cuts[2:])]
    bad = [share(cuts[0], cuts[1]), *(h.result() for h in helpers)]
    return min((b for b in bad if b is not None), default=None)


def _check_ids(src_ids: np.ndarray, src_pool: int, dst_ids: np.ndarray, dst_pool: int) -> None:
    """``BlockIdError`` unless every id names a block of its pool and no destination repeats."""
    for side, ids, pool, distinct in (("source", src_ids, src_pool, False),
                                      ("destination", dst_ids, dst_pool, True)):
        fault = block_id_fault(ids, pool, distinct)
        if fault is not None:
            raise BlockIdError(side, fault)


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
        # (first layer, layer count, layout) of the pool a transport last found this
        # store to be of; the layer tensor is held, so its identity cannot be reused
        self.checked_pool: tuple[object, int, object] | None = None

    @property
    def slabs(self) -> np.ndarray:
        """The pool's byte view the checksums are of (made once, with the pool)."""
        return self._slabs

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

    def copied(self, src: Sequence[int], dst: Sequence[int],
               origin: BlockChecksums | None = None) -> None:
        """Blocks ``dst`` were overwritten whole with blocks ``src`` of this store (a
        fork's copy) or of ``origin``'s, whose blocks have the same bytes (an offload
        from a block-major pool to a host tier)."""
        o = origin or self
        s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        self._sums[d] = o._sums[s]
        self._valid[d] = o._valid[s]

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
