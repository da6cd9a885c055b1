"""A worker actor behind the scheduler's ``WorkerHandle``: the only place the global
scheduler's calls meet Ray.

A KV export is the sender's ``1 + plan.parts`` returns (its ``HandoffInfo``, then the
Arrow batches): the info says the export is done without fetching a batch, and the
batches' object refs go to the receiver, which Ray hands them through the object store
(a shared-memory batch holds only the segment's address and checksums). A device
transport's export is followed by ``send_kv_rows`` called with Ray's ``tensor_transport``
option: its ref goes to the receiver too, and Ray moves the rows device to device (the
actor runs the two calls in order, so the rows are there when asked for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from kvcache.kv_transport import HandoffInfo, HandoffPlan, Transport
from scheduler.worker_handle import KVExport, WorkerLostError


@dataclass
class RayExport:
    info_ref: Any
    batch_refs: list[Any]
    rows_ref: Any = None   # a device transport's rows (Ray Direct Transport)

    async def ready(self) -> HandoffInfo:
        return await _lost_if_dead(self.info_ref)


@dataclass
class RayWorkerHandle:
    """``WorkerHandle`` over a ``workers.worker.Worker`` actor; pickles with its actor."""

    actor: Any

    async def step(self, plan: bytes) -> bytes:
        return await _lost_if_dead(self.actor.step.remote(plan))

    def export_kv(self, block_ids: list[int], block_hashes: list[bytes | None],
                  token_counts: list[int], plan: HandoffPlan) -> KVExport:
        info_ref, *batch_refs = self.actor.export_kv.options(
            num_returns=1 + plan.parts).remote(block_ids, block_hashes, token_counts, plan)
        rows_ref = (self.actor.send_kv_rows.options(
            tensor_transport=plan.tensor_transport).remote(block_ids)
            if plan.transport is Transport.DEVICE else None)
        return RayExport(info_ref, batch_refs, rows_ref)

    async def import_kv(self, export: KVExport, block_ids: list[int], host_first_row: int,
                        host_block_ids: list[int]) -> int:
        assert isinstance(export, RayExport)
        if export.rows_ref is not None:
            return await _lost_if_dead(self.actor.import_kv_device.remote(
                export.batch_refs[0], export.rows_ref, block_ids, host_first_row,
                host_block_ids))
        return await _lost_if_dead(self.actor.import_kv.remote(
            export.batch_refs[0], block_ids, host_first_row, host_block_ids,
            *export.batch_refs[1:]))

    async def ping(self) -> None:
        await _lost_if_dead(self.actor.ping.remote())


async def _lost_if_dead(ref: Any) -> Any:
    """Await an actor call; Ray's word that the actor died becomes ``WorkerLostError``."""
    try:
        return await ref
    except RayActorError as e:
        raise WorkerLostError(str(e)) from e
