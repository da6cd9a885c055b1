"""Stored block checksums: a step seals the blocks it fills, every other write drops or
replaces the checksum, export hashes whatever has none; the threaded verified copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.block_checksum import block_checksums, copy_verified
from kvcache.shm_transport import _slab_bytes, pool_checksums
from tests.kvcache.test_kv_transfer import make_meta
from tests.kvcache.test_shm_transport import shared_pool

BLOCKS = 12


@pytest.fixture
def pool():
    meta = make_meta(torch.float16)
    seg, kv = shared_pool(meta, BLOCKS, seed=21)
    yield meta, kv
    del kv
    seg.close()


def fresh(kv, blocks) -> list[int]:
    return block_checksums(_slab_bytes(kv), blocks).tolist()


def scribble(kv, block: int, seed: int) -> None:
    """Overwrite every layer's K and V of ``block`` with other bytes, telling no one."""
    g = torch.Generator().manual_seed(seed)
    for layer in kv:
        layer[:, block].view(torch.uint8).copy_(torch.randint(
            0, 256, layer[:, block].view(torch.uint8).shape, dtype=torch.uint8, generator=g))


def test_a_step_seals_the_blocks_it_filled_and_forgets_the_ones_it_left_partial(pool):
    meta, kv = pool
    bs = meta.block_size
    sums = pool_checksums(kv)
    sums.seal(range(BLOCKS))
    for b in (3, 5, 8):
        scribble(kv, b, seed=b)
    # block 3 filled whole, block 5 from offset 2 through its last slot, block 8 partly
    slots = np.concatenate([np.arange(3 * bs, 4 * bs), np.arange(5 * bs + 2, 6 * bs),
                            np.arange(8 * bs, 8 * bs + 3)])
    sums.written_slots(slots, bs)
    assert sums.has([3, 5, 8]).tolist() == [True, True, False]
    assert sums.of([3, 5]).tolist() == fresh(kv, [3, 5])
    assert sums.of([8]).tolist() == fresh(kv, [8])   # hashed now, and stored
    assert sums.has([8]).all()
    assert sums.of(range(BLOCKS)).tolist() == fresh(kv, range(BLOCKS))


def test_copies_and_verified_imports_carry_their_checksums(pool):
    _, kv = pool
    sums = pool_checksums(kv)
    sums.seal([1, 4, 6])
    for layer in kv:                      # a fork's copy: 1 -> 6 (sealed), 2 -> 4 (not)
        layer[:, [6, 4]] = layer[:, [1, 2]]
    sums.copied([1, 2], [6, 4])
    assert sums.has([6, 4]).tolist() == [True, False]
    assert sums.of([6, 4]).tolist() == fresh(kv, [6, 4])
    scribble(kv, 7, seed=7)
    sums.stored([7], np.array(fresh(kv, [7]), dtype=np.uint64))
    assert sums.has([7]).all() and sums.of([7]).tolist() == fresh(kv, [7])
    sums.written([7])
    assert not sums.has([7]).any()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_threaded_verified_copy_is_bit_exact_and_finds_a_bad_block(pool, threads,
                                                                        copy_path):
    meta, src = pool
    seg, dst = shared_pool(meta, BLOCKS, seed=22)
    s, d = _slab_bytes(src), _slab_bytes(dst)
    src_ids, dst_ids = [9, 0, 4, 11, 2, 7, 5], [1, 3, 10, 6, 8, 0, 2]
    sums = block_checksums(s, src_ids)
    assert copy_verified(s, src_ids, d, dst_ids, sums, threads) is None
    assert fresh(dst, dst_ids) == sums.tolist()
    assert np.array_equal(d[:, dst_ids], s[:, src_ids])
    wrong = sums.copy()
    wrong[4] ^= np.uint64(1)
    assert copy_verified(s, src_ids, d, dst_ids, wrong, threads) == 4
    del d, dst
    seg.close()
