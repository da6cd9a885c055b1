"""ND <-> NZ: the pure-torch definition against an element-by-element oracle, bit-exact
round trips, and KV handoffs between ND and NZ pools."""

from __future__ import annotations

import pytest
import torch

from kvcache.kv_layout import LAYOUT_ND, LAYOUT_NZ, block_shape, nd_to_nz, nz_tile, nz_to_nd
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.kv_transfer import (
    KVLayoutMeta,
    export_blocks,
    from_ipc_buffer,
    import_blocks,
    to_ipc_bytes,
)

DTYPES = [torch.float16, torch.bfloat16, torch.int8, torch.float32]
SIZES = [(16, 16), (5, 7), (17, 33), (128, 40), (1, 64)]


def random_bits(shape, dtype, seed):
    """Any bit pattern (NaN payloads, subnormals) must survive."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                            dtype=torch.uint8, generator=g))
    return t


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("m,n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nz_holds_every_element_where_the_definition_puts_it(dtype, m, n):
    a = random_bits((m, n), dtype, seed=m * 100 + n)
    z = nd_to_nz(a)
    c0 = nz_tile(dtype)
    assert c0 == {1: 32, 2: 16, 4: 8}[dtype.itemsize]
    assert z.shape == (-(-n // c0), -(-m // 16) * 16, c0)
    seen = torch.zeros(z.shape, dtype=torch.bool)
    for i in range(m):
        for j in range(n):
            assert bits(z[j // c0, i, j % c0]).equal(bits(a[i, j]))
            seen[j // c0, i, j % c0] = True
    assert not bits(z[~seen]).any(), "padding must be zeros"


@pytest.mark.parametrize("m,n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact(dtype, m, n):
    a = random_bits((3, m, n), dtype, seed=7)
    back = nz_to_nd(nd_to_nz(a), m, n)
    assert back.shape == a.shape and bits(back).equal(bits(a))


def test_nz_of_the_wrong_tile_is_refused():
    z = torch.zeros(4, 16, 8, dtype=torch.float16)   # 8-wide tiles: fp32's, not fp16's
    with pytest.raises(ValueError, match="inner tiles of 16"):
        nz_to_nd(z, 16, 32)


def test_the_310p_pool_shape():
    """vllm-ascend's 310P KV shape: (2, num_blocks, kv_heads*head_dim//16, block_size, 16)."""
    shape = KVShape(2, 128, 2, 64, torch.float16, LAYOUT_NZ)
    assert shape.layer_shape(10) == (2, 10, 2 * 64 // 16, 128, 16)
    assert shape.bytes_per_block == KVShape(2, 128, 2, 64, torch.float16).bytes_per_block
    assert block_shape(LAYOUT_NZ, 16, 1, 8, torch.int8) == (1, 16, 32)  # padded columns
    with pytest.raises(ValueError, match="multiple of 16"):
        block_shape(LAYOUT_NZ, 8, 2, 64, torch.float16)


def make_pool(layout, dtype, num_blocks, seed, dims=(2, 32, 2, 24)):
    shape = KVShape(*dims, dtype, layout)
    pool = allocate_kv_cache(shape, num_blocks, torch.device("cpu"))
    for i, kv in enumerate(pool):
        kv.copy_(random_bits(kv.shape, dtype, seed + i))
    return shape, pool


def nd_view(kv, dims=(2, 32, 2, 24)):
    """An NZ pool layer read back through the definition, as ND [2, nb, bs, kvh, hd]."""
    _, bs, kvh, hd = dims
    return nz_to_nd(kv, bs, kvh * hd).view(*kv.shape[:2], bs, kvh, hd)


@pytest.mark.parametrize("via_ipc", [False, True], ids=["in_process", "ipc"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8], ids=str)
def test_handoff_nd_to_nz_and_back_is_bit_exact(dtype, via_ipc):
    def hand(batch):
        return from_ipc_buffer(to_ipc_bytes(batch)) if via_ipc else batch

    nd_shape, nd_pool = make_pool(LAYOUT_ND, dtype, 6, seed=1)
    nz_shape, nz_pool = make_pool(LAYOUT_NZ, dtype, 5, seed=20)
    nd_meta = KVLayoutMeta.from_shape(nd_shape, "f" * 32)
    nz_meta = KVLayoutMeta.from_shape(nz_shape, "f" * 32)
    assert nz_meta.layout == LAYOUT_NZ and nd_meta.layout == LAYOUT_ND
    original = [kv.clone() for kv in nd_pool]

    batch = export_blocks(nd_pool, [4, 0, 2], [None] * 3, [32, 32, 7], nd_meta)
    import_blocks(hand(batch), nz_pool, [1, 3, 0], nz_meta)
    for nd, nz in zip(original, nz_pool):
        assert bits(nd_view(nz)[:, [1, 3, 0]]).equal(bits(nd[:, [4, 0, 2]]))
        assert bits(nz[:, [1, 3, 0]]).equal(
            bits(nd_to_nz(nd[:, [4, 0, 2]].reshape(2, 3, 32, 48))))

    for kv in nd_pool:
        kv.zero_()
    back = export_blocks(nz_pool, [1, 3, 0], [None] * 3, [32, 32, 7], nz_meta)
    assert back.schema.metadata[b"layout"] == b"nz"
    import_blocks(hand(back), nd_pool, [4, 0, 2], nd_meta)
    for nd, orig in zip(nd_pool, original):
        assert bits(nd[:, [4, 0, 2]]).equal(bits(orig[:, [4, 0, 2]]))
