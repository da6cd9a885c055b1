"""The choice of KV transport per pair of workers, and how an export is cut into parts."""

from __future__ import annotations

import pytest

from kvcache.kv_transport import (
    MAX_PART_BYTES,
    HandoffPlan,
    Transport,
    WorkerPlace,
    part_bounds,
    plan_handoff,
)
from kvcache.shm_segment import SegmentHandle


def test_same_node_shares_memory_and_another_node_uses_the_object_store_in_parts():
    handle = SegmentHandle(1, 3, 4, 1 << 30)
    here, there = WorkerPlace("node-a", 1 << 20, handle), WorkerPlace("node-b", 1 << 20, handle)
    assert plan_handoff(here, WorkerPlace("node-a", 1 << 20, handle), 1000) == \
        HandoffPlan(Transport.SHARED_MEMORY, 1)
    per_part = MAX_PART_BYTES // (1 << 20)
    assert plan_handoff(here, there, per_part) == HandoffPlan(Transport.OBJECT_STORE, 1)
    assert plan_handoff(here, there, per_part + 1) == HandoffPlan(Transport.OBJECT_STORE, 2)
    device_pool = WorkerPlace("node-a", 1 << 20, None)   # no shared segment
    assert plan_handoff(here, device_pool, 1).transport is Transport.OBJECT_STORE
    assert plan_handoff(None, here, 5) == HandoffPlan(Transport.OBJECT_STORE, 1)


def test_rows_from_the_senders_host_tier_share_memory_and_never_take_a_device():
    """A host tier lies in a shared segment where the pool does (one node), and on no
    device: there the object store carries them, whatever else the pair shares."""
    handle = SegmentHandle(1, 3, 4, 1 << 30)
    shared = WorkerPlace("node-a", 1 << 20, handle, tensor_transport="nixl")
    assert plan_handoff(shared, shared, 6, 2, [7, 4]) == \
        HandoffPlan(Transport.SHARED_MEMORY, 1, None, 2, (7, 4))
    device = WorkerPlace("node-a", 1 << 20, None, tensor_transport="nixl")
    assert plan_handoff(device, device, 6, 2, [7, 4]) == \
        HandoffPlan(Transport.OBJECT_STORE, 1, None, 2, (7, 4))
    per_part = MAX_PART_BYTES // (1 << 20)
    assert plan_handoff(device, device, per_part + 1, 0, [3]).parts == 2


@pytest.mark.parametrize("rows,parts", [(10, 3), (2, 2), (0, 1), (7, 1)])
def test_parts_cover_every_row_once(rows, parts):
    bounds = part_bounds(rows, parts)
    assert len(bounds) == parts
    assert [r for a, b in bounds for r in range(a, b)] == list(range(rows))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
