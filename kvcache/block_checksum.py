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

from collections.abc import Sequence

import numpy as np
import xxhash


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
                  dst_blocks: Sequence[int], checksums: np.ndarray) -> int | None:
    """Copy each source block to its destination block and hash the copy while it is in
    cache; returns the index of the first block whose copy does not match its checksum
    (the blocks after it are not copied), else None."""
    for i, (s, d) in enumerate(zip(src_blocks, dst_blocks)):
        dst[:, d] = src[:, s]
        if block_checksum(dst, d) != checksums[i]:
            return i
    return None


def row_checksums(rows: np.ndarray) -> np.ndarray:
    """The checksums of contiguous rows ``(n, row_bytes)`` (uint8), such as a KV batch's."""
    return np.fromiter((xxhash.xxh3_64_intdigest(r) for r in rows), dtype=np.uint64,
                       count=len(rows))
