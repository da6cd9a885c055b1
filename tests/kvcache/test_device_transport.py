"""The device transport's halves on host tensors: a description plus one rows tensor,
bit-exact for every dtype, and a corrupted row or a wrong tensor refused untouched; and
the plan picks it only when both workers have the same Ray Direct Transport."""

from __future__ import annotations

import pytest
import torch

from kvcache.device_transport import export_device, import_device, row_sums
from kvcache.kv_transfer import HostRows, KVTransferError
from kvcache.kv_transport import HandoffPlan, Transport, WorkerPlace, plan_handoff
from kvcache.shm_segment import SegmentHandle
from tests.kvcache.test_kv_transfer import (
    SHAPES,
    assert_blocks_equal,
    assert_untouched,
    make_meta,
    seq_blocks,
    snapshot,
)
from tests.kvcache.test_shm_transport import DTYPES, shared_pool


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_device_handoff_is_bit_exact(dtype, shape):
    meta = make_meta(dtype, shape)
    _, src = shared_pool(meta, 8, seed=31)
    _, dst = shared_pool(meta, 8, seed=32)
    summaries = torch.randn(5, meta.num_layers, 2, meta.num_kv_heads, meta.head_dim)
    batch, rows = export_device(src, [5, 0, 7, 2, 6], *seq_blocks(meta, 5), meta, summaries)
    assert "kv" not in batch.schema.names and rows.shape[0] == 5
    host_kv = torch.zeros(meta.num_layers, 2, 3, meta.block_size, meta.num_kv_heads,
                          meta.head_dim, dtype=dtype)
    got = import_device(batch, rows.clone(), dst, [3, 6, 1], meta, HostRows(2, [2, 0], host_kv))
    assert_blocks_equal(dst, [3, 6, 1], src, [5, 0, 6])
    for layer, kv in enumerate(src):
        assert torch.equal(host_kv[layer][:, [2, 0]].view(torch.uint8),
                           kv[:, [7, 2]].view(torch.uint8))
    assert torch.equal(got.summaries, summaries) and got.token_counts == seq_blocks(meta, 5)[1]


def test_row_sums_change_with_any_byte():
    """The independent oracle: the rows' words summed in Python integers mod 2**64."""
    rows = torch.randint(-128, 128, (3, 2, 2, 32), dtype=torch.int8)
    words = rows.reshape(3, -1).view(torch.int64).tolist()
    want = [sum(w) % 2**64 for w in words]
    assert [s % 2**64 for s in row_sums(rows).tolist()] == want
    rows.view(torch.uint8).view(3, -1)[1, 17] ^= 0x40
    assert row_sums(rows).tolist()[1] % 2**64 != want[1]


@pytest.mark.parametrize("damage", ["byte", "shape", "dtype"])
def test_damaged_rows_are_refused_untouched(damage):
    meta = make_meta(torch.float16)
    _, src = shared_pool(meta, 8, seed=33)
    _, dst = shared_pool(meta, 8, seed=34)
    batch, rows = export_device(src, [1, 4, 6], *seq_blocks(meta, 3), meta)
    if damage == "byte":
        rows.view(torch.uint8).view(3, -1)[2, -1] ^= 0x01
    elif damage == "shape":
        rows = rows[:2]
    else:
        rows = rows.float()
    before = snapshot(dst)
    with pytest.raises(KVTransferError, match=r"KV block 2.*corrupted" if damage == "byte"
                       else "KV rows: received"):
        import_device(batch, rows, dst, [0, 2, 5], meta)
    assert_untouched(dst, before)


def test_the_device_transport_is_chosen_only_when_both_workers_have_it():
    seg = SegmentHandle(1, 3, 4, 1 << 20)
    gpu = WorkerPlace("node-a", 4096, None, "nixl")
    assert plan_handoff(gpu, WorkerPlace("node-b", 4096, None, "nixl"), 10) == \
        HandoffPlan(Transport.DEVICE, 1, "nixl")
    # another transport, or none: the host paths
    assert plan_handoff(gpu, WorkerPlace("node-a", 4096, None, "nccl"), 10).transport \
        is Transport.OBJECT_STORE
    assert plan_handoff(WorkerPlace("n", 4096, seg, None), WorkerPlace("n", 4096, seg, "gloo"),
                        10).transport is Transport.SHARED_MEMORY
