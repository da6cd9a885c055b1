"""A worker actor behind the scheduler's ``WorkerHandle``: the only place the global
scheduler's calls meet Ray.

A KV export is the sender's two returns (the payload size, then the Arrow batch): the
size says the export is done without fetching the batch, and the batch's object ref
goes to the receiver, which Ray hands the batch through the object store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from scheduler.worker_handle import KVExport, WorkerLostError


@dataclass
class RayExport:
    size_ref: Any
    batch_ref: Any

    async def ready(self) -> None:
        await _lost_if_dead(self.size_ref)


@dataclass
class RayWorkerHandle:
    """``WorkerHandle`` over a ``workers.worker.Worker`` actor; pickles with its actor."""

    actor: Any

    async def step(self, plan: bytes) -> bytes:
        return await _lost_if_dead(self.actor.step.remote(plan))

    def export_kv(self, block_ids: list[int], block_hashes: list[bytes | None],
                  token_counts: list[int]) -> KVExport:
        size_ref, batch_ref = self.actor.export_kv.options(num_returns=2).remote(
            block_ids, block_hashes, token_counts)
        return RayExport(size_ref, batch_ref)

    async def import_kv(self, export: KVExport, block_ids: list[int], host_first_row: int,
                        host_block_ids: list[int]) -> int:
        assert isinstance(export, RayExport)
        return await _lost_if_dead(self.actor.import_kv.remote(
            export.batch_ref, block_ids, host_first_row, host_block_ids))

    async def ping(self) -> None:
        await _lost_if_dead(self.actor.ping.remote())


async def _lost_if_dead(ref: Any) -> Any:
    """Await an actor call; Ray's word that the actor died becomes ``WorkerLostError``."""
    try:
        return await ref
    except RayActorError as e:
        raise WorkerLostError(str(e)) from e
