"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its tokens and its parent's hash, so equal hashes mean equal
whole prefixes, not just equal blocks. blake2b keeps crafted collisions (which would
leak another request's KV) out of reach, and is stable across processes and hosts,
so a scheduler can match a prompt against any worker's cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int],
                        block_size: int) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
