"""How the global scheduler reaches a worker: one Protocol, whatever carries the calls.

``cluster`` adapts a Ray actor to it; tests adapt an in-process worker. The scheduler
never sees an actor, an object reference or a KV byte: a handoff asks the sender's
handle for an export and hands that export, opaque, to the receiver's handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvcache.kv_transport import HandoffInfo, HandoffPlan, WorkerPlace
from scheduler.protocol import Role


class WorkerLostError(RuntimeError):
    """The worker is gone (its process died or was killed); no call to it will answer."""


class KVExport(Protocol):
    """A sender's KV blocks on their way out; the transport decides what moves and how."""

    async def ready(self) -> HandoffInfo:
        """Return once the sender has exported (its batches are out of its pool): the
        transport it used and the payload's size."""


class WorkerHandle(Protocol):
    """The calls the scheduler makes of a worker; each raises ``WorkerLostError`` once
    the worker is gone, any other exception for a call the worker itself failed."""

    async def step(self, plan: bytes) -> bytes:
        """Run a msgpack ``StepPlan``; the msgpack ``StepOutput``."""

    def export_kv(self, block_ids: list[int], block_hashes: list[bytes | None],
                  token_counts: list[int], plan: HandoffPlan) -> KVExport:
        """Start exporting these blocks through ``plan``'s transport, in its parts
        (submitted at once, so it never waits behind the sender's next step)."""

    async def import_kv(self, export: KVExport, block_ids: list[int], host_first_row: int,
                        host_block_ids: list[int]) -> int:
        """Receive ``export`` into ``block_ids`` (rows from ``host_first_row`` on into the
        host tier's ``host_block_ids``), checked; the payload's size in bytes."""

    async def ping(self) -> None:
        """Answer if alive."""


@dataclass
class WorkerRef:
    """A worker joining a cell: its id, role, handle and the size of its pools."""

    worker_id: str
    role: Role
    handle: WorkerHandle
    num_blocks: int
    host_blocks: int = 0   # its host tier (long contexts)
    place: WorkerPlace | None = None   # where its pool is: picks the KV transport per pair
