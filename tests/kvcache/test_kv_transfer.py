"""The KV batch wire format: bit-exact round trips, and every mismatch refused untouched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from kvcache import kv_transfer
from kvcache.block_hash import hash_block
from kvcache.host_tier import HostKVStore
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.kv_transfer import (
    KVLayoutMeta,
    KVTransferError,
    export_blocks,
    from_ipc_buffer,
    import_blocks,
    to_ipc_bytes,
)
from kvcache.pool_rows import batch_part

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
# (layers, block size, kv heads, head dim): 1 (MQA), 2 and 4 KV heads (GQA pools)
SHAPES = [(2, 16, 2, 8), (3, 32, 1, 16), (1, 16, 4, 4)]
FINGERPRINT = "0123456789abcdef0123456789abcdef"


def make_meta(dtype: torch.dtype = torch.float16,
              shape: tuple[int, ...] = SHAPES[0]) -> KVLayoutMeta:
    return KVLayoutMeta.from_shape(KVShape(*shape, dtype), FINGERPRINT)


def make_pool(meta: KVLayoutMeta, num_blocks: int, seed: int,
              block_major: bool = False) -> list[torch.Tensor]:
    """A pool of random bit patterns: NaN payloads and subnormals must survive too."""
    shape = KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads, meta.head_dim,
                    getattr(torch, meta.dtype))
    pool = allocate_kv_cache(shape, num_blocks, torch.device("cpu"), block_major=block_major)
    g = torch.Generator().manual_seed(seed)
    for kv in pool:
        bits = kv.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=g))
    return pool


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def seq_blocks(meta: KVLayoutMeta, num_blocks: int, last_tokens: int = 5):
    """Hashes and token counts of a sequence whose last block is partial (no hash)."""
    hashes, parent = [], None
    for i in range(num_blocks - 1):
        parent = hash_block(parent, range(i * meta.block_size, (i + 1) * meta.block_size))
        hashes.append(parent)
    return hashes + [None], [meta.block_size] * (num_blocks - 1) + [last_tokens]


def assert_blocks_equal(dst, dst_ids, src, src_ids) -> None:
    for d_layer, s_layer in zip(dst, src, strict=True):
        for d, s in zip(dst_ids, src_ids, strict=True):
            assert torch.equal(bits(d_layer[:, d]), bits(s_layer[:, s]))


def snapshot(pool):
    return [kv.clone() for kv in pool]


def assert_untouched(pool, before) -> None:
    assert all(torch.equal(bits(kv), bits(b)) for kv, b in zip(pool, before, strict=True))


@pytest.mark.parametrize("orders", [(False, False), (True, False), (False, True)],
                         ids=["layer-major", "block-major-to-layer-major",
                              "layer-major-to-block-major"])
@pytest.mark.parametrize("via_ipc", [False, True], ids=["batch", "ipc"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact(dtype, shape, via_ipc, orders):
    """Between pools of either order (kv_tensors): the rows are the same either way."""
    meta = make_meta(dtype, shape)
    src, dst = make_pool(meta, 12, seed=1, block_major=orders[0]), make_pool(
        meta, 10, seed=2, block_major=orders[1])
    src_ids, dst_ids = [7, 2, 9, 4, 0], [1, 8, 3, 5, 6]
    hashes, counts = seq_blocks(meta, len(src_ids))
    before = snapshot(dst)

    batch = export_blocks(src, src_ids, hashes, counts, meta)
    assert batch.num_rows == len(src_ids)
    assert batch.schema.field("kv").type.shape == [*meta.block_shape]
    if via_ipc:
        batch = from_ipc_buffer(to_ipc_bytes(batch))
    got = import_blocks(batch, dst, dst_ids, meta)

    assert (got.block_ids, got.block_hashes, got.token_counts) == (dst_ids, hashes, counts)
    assert_blocks_equal(dst, dst_ids, src, src_ids)
    others = [b for b in range(10) if b not in dst_ids]
    assert_blocks_equal(dst, others, before, others)


def test_round_trip_between_pools_of_separately_allocated_layers():
    """A pool whose layers are not one allocation moves layer by layer, as exactly."""
    meta = make_meta(torch.bfloat16, SHAPES[1])
    src = [kv.clone() for kv in make_pool(meta, 6, seed=21)]
    dst = [kv.clone() for kv in make_pool(meta, 6, seed=22)]
    hashes, counts = seq_blocks(meta, 3)
    batch = export_blocks(src, [5, 0, 3], hashes, counts, meta)
    import_blocks(from_ipc_buffer(to_ipc_bytes(batch)), dst, [2, 4, 1], meta)
    assert_blocks_equal(dst, [2, 4, 1], src, [5, 0, 3])


def test_suffix_export_completes_a_cached_prefix():
    """The receiver holds the first blocks in its prefix cache; only the rest travels."""
    meta = make_meta(torch.bfloat16)
    src, dst = make_pool(meta, 8, seed=3), make_pool(meta, 8, seed=4)
    seq, held = [5, 1, 6, 2, 7], 2
    hashes, counts = seq_blocks(meta, len(seq), last_tokens=1)

    batch = export_blocks(src, seq[held:], hashes[held:], counts[held:], meta)
    got = import_blocks(from_ipc_buffer(to_ipc_bytes(batch)), dst, [0, 3, 4], meta)

    assert got.block_hashes == hashes[held:] and got.token_counts == counts[held:]
    assert_blocks_equal(dst, [0, 3, 4], src, seq[held:])


def test_empty_batch_round_trips():
    meta = make_meta()
    batch = export_blocks(make_pool(meta, 2, seed=5), [], [], [], meta)
    got = import_blocks(from_ipc_buffer(to_ipc_bytes(batch)), make_pool(meta, 2, seed=6), [],
                        meta)
    assert got.block_ids == [] and got.token_counts == []


def test_a_held_batch_keeps_its_rows_when_the_next_export_reuses_the_buffer():
    """Export reuses its host buffer only once no batch holds it."""
    meta = make_meta(torch.float32)
    src = make_pool(meta, 8, seed=17)
    first = export_blocks(src, [6, 1, 3], *seq_blocks(meta, 3), meta)
    export_blocks(src, [0, 2, 4], *seq_blocks(meta, 3), meta)   # dropped: buffer free again
    export_blocks(src, [7, 5, 0], *seq_blocks(meta, 3), meta)
    dst = make_pool(meta, 8, seed=18)
    import_blocks(first, dst, [2, 4, 7], meta)
    assert_blocks_equal(dst, [2, 4, 7], src, [6, 1, 3])


def test_ipc_read_is_zero_copy():
    meta = make_meta(torch.float32)
    buf = to_ipc_bytes(export_blocks(make_pool(meta, 4, seed=7), [3, 0], *seq_blocks(meta, 2),
                                     meta))
    values = from_ipc_buffer(buf).column("kv").storage.flatten().buffers()[1]
    assert buf.address <= values.address < values.address + values.size <= buf.address + buf.size


MISMATCHES = {
    "fingerprint": {"fingerprint": "f" * 32},
    "dtype": {"dtype": "float32"},
    "block_size": {"block_size": 32},
    "num_layers": {"num_layers": 3},
    "num_kv_heads": {"num_kv_heads": 1},
    "head_dim": {"head_dim": 16},
}


@pytest.mark.parametrize("field", list(MISMATCHES))
def test_layout_mismatch_is_refused_before_any_write(field):
    sent = make_meta()
    batch = from_ipc_buffer(to_ipc_bytes(
        export_blocks(make_pool(sent, 4, seed=8), [1, 2], *seq_blocks(sent, 2), sent)))
    expected = dataclasses.replace(sent, **MISMATCHES[field])
    dst = make_pool(expected, 4, seed=9)
    before = snapshot(dst)

    with pytest.raises(KVTransferError) as err:
        import_blocks(batch, dst, [0, 1], expected)

    msg = str(err.value)
    assert field in msg
    assert repr(str(getattr(sent, field))) in msg and repr(str(getattr(expected, field))) in msg
    assert_untouched(dst, before)


def test_an_unknown_layout_is_refused_before_any_write():
    meta = make_meta()
    batch = export_blocks(make_pool(meta, 4, seed=8), [1, 2], *seq_blocks(meta, 2), meta)
    batch = batch.replace_schema_metadata({**batch.schema.metadata, b"layout": b"hnd"})
    dst = make_pool(meta, 4, seed=9)
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match=r"layout: received 'hnd', expected 'nd'"):
        import_blocks(batch, dst, [0, 1], meta)
    assert_untouched(dst, before)


def test_row_count_mismatch_is_refused():
    meta = make_meta()
    batch = export_blocks(make_pool(meta, 4, seed=10), [0, 1, 2], *seq_blocks(meta, 3), meta)
    dst = make_pool(meta, 4, seed=11)
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match=r"rows: received 3, expected 2"):
        import_blocks(batch, dst, [0, 1], meta)
    assert_untouched(dst, before)


def test_missing_metadata_is_refused():
    meta = make_meta()
    batch = export_blocks(make_pool(meta, 2, seed=12), [0], [None], [3], meta)
    with pytest.raises(KVTransferError, match=r"format_version: received nothing"):
        import_blocks(batch.replace_schema_metadata({}), make_pool(meta, 2, seed=13), [1], meta)


@pytest.mark.parametrize("chunk", [16 << 20, 1024], ids=["one_chunk", "many_chunks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_flipped_payload_byte_is_caught_by_the_checksum(dtype, chunk, monkeypatch):
    monkeypatch.setattr(kv_transfer, "_CHECKSUM_CHUNK", chunk)
    meta = make_meta(dtype)
    buf = to_ipc_bytes(export_blocks(make_pool(meta, 6, seed=14), [4, 1, 3],
                                     *seq_blocks(meta, 3), meta))
    values = from_ipc_buffer(buf).column("kv").storage.flatten().buffers()[1]
    start = values.address - buf.address
    dst = make_pool(meta, 6, seed=15)
    before = snapshot(dst)
    rng = np.random.default_rng(16)
    for pos in [start, start + values.size - 1, *(start + rng.integers(0, values.size, 3))]:
        corrupted = bytearray(buf)
        corrupted[pos] ^= 0x01
        with pytest.raises(KVTransferError, match="checksum"):
            import_blocks(from_ipc_buffer(corrupted), dst, [0, 2, 5], meta)
    assert_untouched(dst, before)


@pytest.mark.parametrize("shape", [(1, 1, 1, 3), (2, 4, 1, 5)], ids=["6B_rows", "80B_rows"])
def test_every_single_byte_flip_is_caught(shape, monkeypatch):
    """Any byte of a payload whose size is no multiple of 8 (tail bytes) or of the chunk."""
    monkeypatch.setattr(kv_transfer, "_CHECKSUM_CHUNK", 16)
    meta = make_meta(torch.int8, shape)
    buf = to_ipc_bytes(export_blocks(make_pool(meta, 4, seed=19), [3, 0, 2],
                                     *seq_blocks(meta, 3, last_tokens=1), meta))
    values = from_ipc_buffer(buf).column("kv").storage.flatten().buffers()[1]
    start = values.address - buf.address
    dst = make_pool(meta, 4, seed=20)
    before = snapshot(dst)
    for pos in range(start, start + values.size):
        corrupted = bytearray(buf)
        corrupted[pos] ^= 0x80
        with pytest.raises(KVTransferError, match="checksum"):
            import_blocks(from_ipc_buffer(corrupted), dst, [0, 1, 3], meta)
    assert_untouched(dst, before)


def _with_column(batch: pa.RecordBatch, name: str, column: pa.Array) -> pa.RecordBatch:
    columns = [column if n == name else batch.column(n) for n in batch.schema.names]
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


@pytest.mark.parametrize("tamper", ["token_count", "hash_byte", "hash_dropped"])
def test_altered_token_counts_and_hashes_are_caught(tamper):
    meta = make_meta()
    hashes, counts = seq_blocks(meta, 3)
    batch = export_blocks(make_pool(meta, 4, seed=17), [0, 1, 2], hashes, counts, meta)
    if tamper == "token_count":
        batch = _with_column(batch, "num_tokens", pa.array([16, 16, 6], type=pa.int32()))
    elif tamper == "hash_byte":
        bad = bytes([hashes[1][0] ^ 0x80]) + hashes[1][1:]
        batch = _with_column(batch, "block_hash", pa.array([hashes[0], bad, None], pa.binary()))
    else:
        batch = _with_column(batch, "block_hash", pa.array([hashes[0], None, None], pa.binary()))
    dst = make_pool(meta, 4, seed=18)
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match="checksum"):
        import_blocks(batch, dst, [3, 2, 1], meta)
    assert_untouched(dst, before)


def test_bad_destination_ids_are_refused_untouched():
    meta = make_meta()
    batch = export_blocks(make_pool(meta, 4, seed=19), [0, 1], *seq_blocks(meta, 2), meta)
    dst = make_pool(meta, 4, seed=20)
    before = snapshot(dst)
    for ids in ([0, 4], [2, 2], [-1, 0]):
        with pytest.raises(ValueError, match="dst_block_ids"):
            import_blocks(batch, dst, ids, meta)
    assert_untouched(dst, before)


def test_export_refuses_inconsistent_arguments():
    meta = make_meta()
    pool = make_pool(meta, 4, seed=21)
    with pytest.raises(ValueError, match="token counts"):
        export_blocks(pool, [0, 1], [None, None], [16], meta)
    with pytest.raises(ValueError, match=r"num_tokens\[1\]: got 17"):
        export_blocks(pool, [0, 1], [None, None], [16, 17], meta)
    with pytest.raises(ValueError, match="kv_caches"):
        export_blocks(pool, [0], [None], [1], dataclasses.replace(meta, head_dim=16))


def test_unreadable_ipc_bytes_are_a_transfer_error():
    with pytest.raises(KVTransferError, match="IPC stream"):
        from_ipc_buffer(b"\x00" * 7 + b"not arrow")


@pytest.mark.parametrize("via_ipc", [False, True], ids=["batch", "ipc"])
def test_summaries_and_host_rows_arrive_bit_exact(via_ipc):
    """Summaries travel with their blocks; rows 1..2 go to host-tier blocks, the others to
    the pool, each bit for bit."""
    meta = make_meta(torch.float16)
    src, dst = make_pool(meta, 8, seed=30), make_pool(meta, 8, seed=31)
    summaries = torch.randn(5, meta.num_layers, 2, meta.num_kv_heads, meta.head_dim,
                            generator=torch.Generator().manual_seed(32))
    src_ids = [6, 1, 4, 0, 3]
    batch = export_blocks(src, src_ids, *seq_blocks(meta, 5), meta, summaries)
    if via_ipc:
        batch = from_ipc_buffer(to_ipc_bytes(batch))
    host_kv = torch.zeros(meta.num_layers, 2, 4, meta.block_size, meta.num_kv_heads,
                          meta.head_dim, dtype=torch.float16)
    got = import_blocks(batch, dst, [5, 2, 7], meta,
                        kv_transfer.HostRows(1, [3, 0], host_kv))
    assert torch.equal(got.summaries, summaries)
    assert_blocks_equal(dst, [5, 2, 7], src, [6, 0, 3])
    for layer, kv in enumerate(src):
        assert torch.equal(bits(host_kv[layer][:, [3, 0]]), bits(kv[:, [1, 4]]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=str)
@pytest.mark.parametrize("block_major", [False, True], ids=["layer-major", "block-major"])
def test_host_rows_are_exported_from_the_host_tier_bit_exact(dtype, block_major):
    """A sequence in offload mode: its rows 1..2 are in the sender's host tier, the others
    in its pool. Exported in two parts split inside the host rows (``batch_part``), and
    imported into a pool, every row is the sender's, bit for bit."""
    meta = make_meta(dtype)
    src, dst = make_pool(meta, 8, seed=40, block_major=block_major), make_pool(meta, 8, seed=41)
    store = HostKVStore(KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads,
                                meta.head_dim, dtype), 4)
    store.kv.view(torch.uint8).copy_(torch.randint(
        0, 256, store.kv.view(torch.uint8).shape, dtype=torch.uint8,
        generator=torch.Generator().manual_seed(42)))
    host = kv_transfer.HostRows(1, [2, 0], store.kv)
    hashes, counts = seq_blocks(meta, 5)
    got = []
    for a, b in ((0, 2), (2, 5)):
        ids, part_host = batch_part([6, 1, 3], host, a, b)
        got.append((ids, part_host and (part_host.first_row, part_host.block_ids)))
        batch = export_blocks(src, ids, hashes[a:b], counts[a:b], meta, host=part_host)
        import_blocks(from_ipc_buffer(to_ipc_bytes(batch)), dst, list(range(a, b)), meta)
    assert got == [([6], (1, [2])), ([1, 3], (0, [0]))]
    assert_blocks_equal(dst, [0, 3, 4], src, [6, 1, 3])
    for layer, kv in enumerate(dst):
        assert torch.equal(bits(kv[:, [1, 2]]), bits(store.kv[layer][:, [2, 0]]))


def test_corrupted_summaries_are_refused():
    meta = make_meta(torch.float32)
    src, dst = make_pool(meta, 4, seed=33), make_pool(meta, 4, seed=34)
    summaries = torch.randn(2, meta.num_layers, 1, meta.num_kv_heads, meta.head_dim)
    buf = bytearray(to_ipc_bytes(export_blocks(src, [0, 1], *seq_blocks(meta, 2), meta,
                                               summaries)))
    payload = summaries.numpy().tobytes()
    at = bytes(buf).index(payload[:64])   # the summary column's bytes in the stream
    buf[at + 5] ^= 0x01
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match="checksum"):
        import_blocks(from_ipc_buffer(bytes(buf)), dst, [2, 3], meta)
    assert_untouched(dst, before)
