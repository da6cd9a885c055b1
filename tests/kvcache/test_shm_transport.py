"""The shared-memory KV transport: the one-copy handoff bit for bit, rows from and into
host tiers, corruption and a killed sender refused or survived cleanly."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import crc32c
import numpy as np
import pyarrow as pa
import pytest
import torch

from kvcache import kv_transport, shm_transport
from kvcache.block_checksum import block_checksum, block_checksums, copy_verified
from kvcache.host_tier import HostKVStore
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.kv_transfer import HostRows, KVTransferError, export_blocks, from_ipc_buffer
from kvcache.shm_segment import PeerSegments, SegmentHandle, SharedSegment
from kvcache.shm_transport import _slab_bytes, export_shared, import_shared, pool_checksums
from tests.kvcache.test_kv_transfer import (
    SHAPES,
    assert_blocks_equal,
    assert_untouched,
    make_meta,
    seq_blocks,
    snapshot,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
REPO = Path(__file__).resolve().parents[2]


def shared_pool(meta, num_blocks: int, seed: int,
                block_major: bool = True) -> tuple[SharedSegment, list[torch.Tensor]]:
    """A pool of random bit patterns in a shared segment, block-major as a worker's host
    pool is (unless told otherwise)."""
    shape = KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads, meta.head_dim,
                    getattr(torch, meta.dtype))
    segment = SharedSegment(num_blocks * shape.bytes_per_block)
    segment.buffer[:] = np.random.default_rng(seed).integers(
        0, 256, segment.handle.nbytes, dtype=np.uint8).tobytes()
    return segment, allocate_kv_cache(shape, num_blocks, torch.device("cpu"), segment.buffer,
                                      block_major)


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shared_memory_handoff_is_bit_exact(dtype, shape, copy_path, block_major):
    meta = make_meta(dtype, shape)
    seg, src = shared_pool(meta, 8, seed=1, block_major=block_major)
    _, dst = shared_pool(meta, 8, seed=2, block_major=block_major)
    src_ids, dst_ids = [5, 0, 7, 2], [3, 6, 1, 4]
    batch = export_shared(src, src_ids, *seq_blocks(meta, 4), meta, seg.handle,
                          pool_checksums(src))
    assert "kv" not in batch.schema.names   # a description: the bytes never leave the pool
    before = snapshot(dst)
    got = import_shared(batch, dst, dst_ids, meta, PeerSegments(), pool_checksums(dst))
    assert_blocks_equal(dst, dst_ids, src, src_ids)
    assert_blocks_equal(dst, [0, 2, 5, 7], before, [0, 2, 5, 7])
    assert got.block_ids == dst_ids and got.token_counts == seq_blocks(meta, 4)[1]


def test_partial_handoff_completes_the_prefix_the_receiver_holds():
    """The receiver's prefix cache holds the first two blocks: only the rest moves, and the
    receiver's copy of the prefix is left as it is."""
    meta = make_meta(torch.bfloat16)
    seg, src = shared_pool(meta, 8, seed=3)
    _, dst = shared_pool(meta, 8, seed=4)
    seq_src, seq_dst = [4, 1, 6, 2, 7], [0, 5, 3, 2, 6]
    for d_layer, s_layer in zip(dst, src):
        d_layer[:, seq_dst[:2]] = s_layer[:, seq_src[:2]]
    hashes, counts = seq_blocks(meta, 5)
    batch = export_shared(src, seq_src[2:], hashes[2:], counts[2:], meta, seg.handle,
                          pool_checksums(src))
    import_shared(batch, dst, seq_dst[2:], meta, PeerSegments(), pool_checksums(dst))
    assert_blocks_equal(dst, seq_dst, src, seq_src)


def test_host_rows_and_summaries_arrive_bit_exact():
    meta = make_meta(torch.float16)
    seg, src = shared_pool(meta, 8, seed=5)
    _, dst = shared_pool(meta, 8, seed=6)
    summaries = torch.randn(5, meta.num_layers, 2, meta.num_kv_heads, meta.head_dim)
    batch = export_shared(src, [6, 1, 4, 0, 3], *seq_blocks(meta, 5), meta, seg.handle,
                          pool_checksums(src), summaries)
    host_kv = HostKVStore(KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads,
                                  meta.head_dim, torch.float16), 4).kv
    host_kv.zero_()
    got = import_shared(batch, dst, [5, 2, 7], meta, PeerSegments(), pool_checksums(dst),
                        HostRows(1, [3, 0], host_kv))
    assert torch.equal(got.summaries, summaries)
    assert_blocks_equal(dst, [5, 2, 7], src, [6, 0, 3])
    for layer, kv in enumerate(src):
        assert torch.equal(host_kv[layer][:, [3, 0]].view(torch.uint8),
                           kv[:, [1, 4]].view(torch.uint8))


def _shared_host_tier(meta, num_blocks: int, seed: int) -> HostKVStore:
    shape = KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads, meta.head_dim,
                    getattr(torch, meta.dtype))
    store = HostKVStore(shape, num_blocks, shared=True)
    store.segment.buffer[:] = np.random.default_rng(seed).integers(
        0, 256, store.segment.handle.nbytes, dtype=np.uint8).tobytes()
    return store


def _export_with_host_rows(meta, seed: int):
    """A sender's six rows: pool blocks 6, 1 (rows 0-1), host blocks 4, 0, 2 (rows 2-4),
    pool block 3 (row 5); the sender's pool, host tier and description."""
    seg, src = shared_pool(meta, 8, seed=seed)
    host = _shared_host_tier(meta, 5, seed=seed + 1)
    rows = shm_transport.SharedHostRows(HostRows(2, [4, 0, 2], host.kv), host.segment.handle,
                                       pool_checksums(list(host.kv.unbind(0))))
    batch = export_shared(src, [6, 1, 3], *seq_blocks(meta, 6), meta, seg.handle,
                          pool_checksums(src), host=rows)
    return src, host, batch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_from_the_senders_host_tier_arrive_bit_exact(dtype):
    """The receiver's host tier takes rows 1-3: rows come from each of the sender's two
    stores into each of the receiver's two, every one a copy of its own block."""
    meta = make_meta(dtype)
    src, host, batch = _export_with_host_rows(meta, seed=11)
    _, dst = shared_pool(meta, 8, seed=13)
    receiver = HostKVStore(KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads,
                                   meta.head_dim, dtype), 4).kv
    sums, host_sums = pool_checksums(dst), pool_checksums(list(receiver.unbind(0)))
    got = import_shared(batch, dst, [2, 7, 5], meta, PeerSegments(), sums,
                        HostRows(1, [3, 1, 0], receiver), host_sums)
    sender_rows = [("pool", 6), ("pool", 1), ("host", 4), ("host", 0), ("host", 2),
                   ("pool", 3)]
    receiver_rows = [("pool", 2), ("host", 3), ("host", 1), ("host", 0), ("pool", 7),
                     ("pool", 5)]
    stores = {"pool": {"src": src, "dst": dst},
              "host": {"src": list(host.kv.unbind(0)), "dst": list(receiver.unbind(0))}}
    for (s_kind, s_id), (d_kind, d_id) in zip(sender_rows, receiver_rows):
        assert_blocks_equal(stores[d_kind]["dst"], [d_id], stores[s_kind]["src"], [s_id])
    assert got.block_ids == [2, 7, 5]
    for store, ids in ((sums, [2, 7, 5]), (host_sums, [3, 1, 0])):   # verified as they landed
        assert store.has(ids).all()
        assert (store.of(ids) == block_checksums(store.slabs, ids)).all()


def test_a_host_row_changed_after_its_export_is_refused():
    """Its checksum was the host tier's stored one: the copy of row 3 (host block 0) does
    not match it, and the import names that row."""
    meta = make_meta(torch.float16)
    _, host, batch = _export_with_host_rows(meta, seed=17)
    _, dst = shared_pool(meta, 8, seed=19)
    host.kv[1, 0, 0].view(torch.uint8).flatten()[0] ^= 1
    with pytest.raises(KVTransferError, match=r"KV block 3 \(sender block 0\)"):
        import_shared(batch, dst, [0, 1, 2, 3, 4, 5], meta, PeerSegments(),
                      pool_checksums(dst))


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
def test_block_checksum_is_crc32c_of_the_batch_row(block_major):
    """Taken over the pool's runs in place, it equals CRC32C of the row the object-store
    batch carries for that block (an independent computation over contiguous bytes)."""
    meta = make_meta(torch.float32, SHAPES[1])
    _, pool = shared_pool(meta, 4, seed=7, block_major=block_major)
    batch = export_blocks(pool, [2, 0], *seq_blocks(meta, 2), meta)
    rows = np.frombuffer(batch.column("kv").storage.flatten().buffers()[1],
                         dtype=np.uint8).reshape(2, -1)
    want = [crc32c.crc32c(r.tobytes()) for r in rows]
    assert [block_checksum(_slab_bytes(pool), b) for b in (2, 0)] == want


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_byte_flipped_in_the_senders_pool_after_export_is_refused(where, copy_path):
    meta = make_meta(torch.float16)
    seg, src = shared_pool(meta, 8, seed=8)
    _, dst = shared_pool(meta, 8, seed=9)
    src_ids = [2, 5, 1]
    batch = export_shared(src, src_ids, *seq_blocks(meta, 3), meta, seg.handle,
                          pool_checksums(src))
    row = {"first": 0, "middle": 1, "last": 2}[where]
    victim = src[meta.num_layers - 1][1, src_ids[row]].view(torch.uint8).view(-1)
    victim[-1] ^= 0x10   # V of the last layer, the last byte of the block
    others = [b for b in range(8) if b not in (3, 6, 0)]
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match=rf"KV block {row} \(sender block "
                                               rf"{src_ids[row]}\).*checksum"):
        import_shared(batch, dst, [3, 6, 0], meta, PeerSegments(), pool_checksums(dst))
    assert_blocks_equal(dst, others, before, others)


def test_a_sender_block_outside_its_pool_is_a_transfer_error_a_repeated_destination_ours(
        copy_path):
    """A description naming a block the sender's pool does not have is refused as a
    transfer (recomputed); our own repeated destination is a local ValueError. Neither
    moves a byte or changes the pool's stored checksums."""
    meta = make_meta(torch.float16)
    seg, src = shared_pool(meta, 4, seed=19)
    _, dst = shared_pool(meta, 4, seed=20)
    store = pool_checksums(dst)
    store.seal([0, 1, 2, 3])
    sums = store.of([0, 1, 2, 3])
    batch = export_shared(src, [0, 1], *seq_blocks(meta, 2), meta, seg.handle,
                          pool_checksums(src))
    columns = batch.columns
    columns[batch.schema.get_field_index("src_block")] = pa.array([0, 4], pa.int32())
    digest = kv_transport._digest(batch.column("num_tokens").to_numpy(),
                                  batch.column("block_hash").to_pylist(),
                                  batch.column("checksum").to_numpy(), None,
                                  np.array([0, 4], dtype=np.int32))
    forged = pa.RecordBatch.from_arrays(columns, schema=batch.schema.with_metadata(
        {**batch.schema.metadata, b"digest": digest.encode()}))
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match=r"src_block: .*got 0..4; expected ids in \[0, 4\)"):
        import_shared(forged, dst, [2, 3], meta, PeerSegments(), store)
    with pytest.raises(ValueError, match="expected distinct ids") as refused:
        import_shared(batch, dst, [3, 3], meta, PeerSegments(), store)
    assert not isinstance(refused.value, KVTransferError)
    assert_untouched(dst, before)
    assert store.has([0, 1, 2, 3]).all() and (store.of([0, 1, 2, 3]) == sums).all()


def test_a_block_major_pool_holds_each_block_as_one_run_in_row_order():
    """What makes a handoff one copy a block: the pool's bytes of a block are the row the
    object-store batch carries, at block * row bytes from the pool's start."""
    meta = make_meta(torch.bfloat16, SHAPES[0])
    seg, pool = shared_pool(meta, 5, seed=22)
    rows = export_blocks(pool, [3, 0], *seq_blocks(meta, 2), meta).column("kv").storage
    row_bytes = np.frombuffer(rows.flatten().buffers()[1], dtype=np.uint8).reshape(2, -1)
    segment = np.frombuffer(seg.buffer, dtype=np.uint8)
    for row, block in zip(row_bytes, (3, 0)):
        assert (segment[block * row.size:(block + 1) * row.size] == row).all()
    assert _slab_bytes(pool).shape == (1, 5, row_bytes.shape[1])


@pytest.mark.parametrize("dtype,block_major,refusal", [
    (torch.float32, True, "dtype"),
    # the receiver would read the sender's segment in its own order and mix up bytes
    (torch.float16, False, "1 runs, this one in 4"),
], ids=["dtype", "order"])
def test_a_description_for_another_pool_is_refused_untouched(dtype, block_major, refusal):
    meta = make_meta(torch.float16)
    seg, src = shared_pool(meta, 4, seed=10)
    other = make_meta(dtype)
    _, dst = shared_pool(other, 4, seed=11, block_major=block_major)
    batch = export_shared(src, [0, 1], *seq_blocks(meta, 2), meta, seg.handle,
                          pool_checksums(src))
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match=refusal):
        import_shared(batch, dst, [2, 3], other, PeerSegments(), pool_checksums(dst))
    assert_untouched(dst, before)


def test_a_pool_with_another_pools_checksums_or_layout_is_a_local_error():
    """The caller's own pool, its checksum store and its layout must agree: a ValueError
    (a bug here, not a transfer to recompute), before any byte moves."""
    meta = make_meta(torch.float16)
    seg, src = shared_pool(meta, 4, seed=14)
    _, dst = shared_pool(meta, 4, seed=15)
    _, wider = shared_pool(meta, 5, seed=16)
    fp32 = make_meta(torch.float32)
    for pool, store, layout in ((src, pool_checksums(dst), meta),
                                (src, pool_checksums(wider), meta),
                                (src, pool_checksums(src), fp32)):
        with pytest.raises(ValueError, match="kv_caches: .*expected"):
            export_shared(pool, [0, 1], *seq_blocks(layout, 2), layout, seg.handle, store)
    batch = export_shared(src, [0, 1], *seq_blocks(meta, 2), meta, seg.handle,
                          pool_checksums(src))
    before = snapshot(dst)
    with pytest.raises(ValueError, match="kv_caches: .*expected") as refused:
        import_shared(batch, dst, [2, 3], meta, PeerSegments(), pool_checksums(src))
    assert not isinstance(refused.value, KVTransferError)
    assert_untouched(dst, before)


def test_a_store_checked_once_still_refuses_another_pool_or_layout():
    """The pool check is remembered per store after it passes; the memory must not let
    another pool, a pool of fewer layers, or another layout through with that store."""
    meta = make_meta(torch.float16)
    seg, src = shared_pool(meta, 4, seed=17)
    _, other = shared_pool(meta, 4, seed=18)
    store = pool_checksums(src)
    export_shared(src, [0, 1], *seq_blocks(meta, 2), meta, seg.handle, store)
    bf16 = make_meta(torch.bfloat16)
    for pool, layout in ((other, meta), (src[:-1], meta), (src, bf16)):
        with pytest.raises(ValueError, match="kv_caches: .*expected"):
            export_shared(pool, [0, 1], *seq_blocks(layout, 2), layout, seg.handle, store)
    export_shared(src, [0, 1], *seq_blocks(meta, 2), meta, seg.handle, store)


_SENDER = textwrap.dedent("""
    import sys, time
    import numpy as np, torch
    from kvcache.kv_tensors import KVShape, allocate_kv_cache
    from kvcache.kv_transfer import to_ipc_bytes
    from kvcache.shm_transport import export_shared, pool_checksums
    from tests.kvcache.test_kv_transfer import make_meta, seq_blocks
    meta = make_meta(torch.float16)
    shape = KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads, meta.head_dim,
                    torch.float16)
    from kvcache.shm_segment import SharedSegment
    seg = SharedSegment(8 * shape.bytes_per_block, name="kvpool-killed-sender")
    seg.buffer[:] = np.random.default_rng(12).integers(
        0, 256, seg.handle.nbytes, dtype=np.uint8).tobytes()
    pool = allocate_kv_cache(shape, 8, torch.device("cpu"), seg.buffer, block_major=True)
    batch = export_shared(pool, [6, 2, 4], *seq_blocks(meta, 3), meta, seg.handle,
                          pool_checksums(pool))
    open(sys.argv[1], "wb").write(to_ipc_bytes(batch))
    print("ready", flush=True)
    time.sleep(600)
""")


def _start_sender(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "description.arrow"
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, out


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _mapped_here(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


@pytest.mark.slow
def test_a_sender_killed_mid_handoff_leaves_a_consistent_receiver_and_no_segment(tmp_path):
    """Killed while the receiver copies, the sender's pages live on in the receiver's
    mapping, so the copy completes bit for bit; a handoff from it after its death is
    refused with the pool untouched; its mapping is dropped at the next handoff and
    unmapped when the copy lets go; no file is left in /dev/shm at any point."""
    shm_before = set(os.listdir("/dev/shm"))
    meta = make_meta(torch.float16)
    _, dst = shared_pool(meta, 8, seed=13)
    proc, out = _start_sender(tmp_path)
    batch = from_ipc_buffer(out.read_bytes())
    handle = SegmentHandle(*(int(batch.schema.metadata[f"segment_{k}".encode()])
                             for k in ("pid", "fd", "inode", "nbytes")))
    peers = PeerSegments()
    # Mid-handoff: import_shared has mapped the segment and copies out of this view.
    shape = _slab_bytes(dst).shape   # the segment may be longer (huge pages round it up)
    source = np.frombuffer(peers.map(handle), dtype=np.uint8,
                           count=math.prod(shape)).reshape(shape)
    assert set(os.listdir("/dev/shm")) == shm_before   # the segment has no name
    assert _mapped_here("kvpool-killed-sender")
    _kill(proc)
    checksums = batch.column("checksum").to_numpy()
    assert copy_verified(source, [6, 2, 4], _slab_bytes(dst), [1, 7, 3], checksums) is None
    want = np.random.default_rng(12).integers(0, 256, handle.nbytes, dtype=np.uint8)
    src = allocate_kv_cache(KVShape(meta.num_layers, meta.block_size, meta.num_kv_heads,
                                    meta.head_dim, torch.float16), 8, torch.device("cpu"),
                            memoryview(want), block_major=True)
    assert_blocks_equal(dst, [1, 7, 3], src, [6, 2, 4])
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match="cannot open.*owner has exited"):
        import_shared(batch, dst, [0, 2, 5], meta, peers, pool_checksums(dst))
    assert_untouched(dst, before)
    assert len(peers) == 0   # pruned by that handoff; unmapped when the copy lets go
    del source
    assert not _mapped_here("kvpool-killed-sender")
    assert set(os.listdir("/dev/shm")) == shm_before
