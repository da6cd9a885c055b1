"""Adopting a running cell: the process that owned it (an ``LLMCell`` replica) died and
was restarted, but its scheduler and workers, detached actors, still serve.

The new owner takes the cell over instead of launching another: the scheduler it finds
by name, the workers by theirs (``WorkerPools.find_named``). A loaded worker the
scheduler does not know yet (its launch had not joined when the owner died) joins now;
a scheduler that is itself recovering gets the workers from the pool manager's first
round. With no answering scheduler or no live worker the cell is really gone: the
caller launches a new one, and the routers re-attach to it by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cluster.pools import WorkerPools
from scheduler.config import CellConfig
from scheduler.worker_handle import WorkerRef
from workers.worker import WorkerInfo

log = logging.getLogger(__name__)

_ANSWER_TIMEOUT_S = 30.0


@dataclass
class RunningCell:
    scheduler: Any
    settings: CellConfig
    workers: list[WorkerRef]
    info: WorkerInfo   # one worker's: the model's fingerprint and end tokens

    def started(self, pools: WorkerPools) -> list[tuple[str, int, Any]]:
        """The workers as ``WorkerPools.serve`` takes them: (id, pool, actor)."""
        return [(w.worker_id, pools.pool_of(w.role), w.handle.actor) for w in self.workers]


def adopt(name: str, namespace: str, pools: WorkerPools) -> RunningCell | None:
    """The running cell whose scheduler is ``name``, taken over; None if it is gone
    (its workers found by name are then stopped: a new cell takes their place)."""
    found = pools.find_named(_ANSWER_TIMEOUT_S)
    try:
        scheduler = ray.get_actor(name, namespace=namespace)
        settings: CellConfig = ray.get(scheduler.settings.remote(), timeout=_ANSWER_TIMEOUT_S)
        stats = ray.get(scheduler.stats.remote(), timeout=_ANSWER_TIMEOUT_S)
    except (ValueError, RayActorError, GetTimeoutError) as e:
        log.info("no running cell to adopt under %s: %s", name, type(e).__name__)
        scheduler = None
    if scheduler is None or not found:
        for ref, _ in found:
            ray.kill(ref.handle.actor)
        return None
    joined = {w.worker_id for w in stats.live()}
    if not stats.recovering:
        for ref, _ in found:
            if ref.worker_id not in joined:
                ray.get(scheduler.add_worker.remote(ref))
    log.warning("adopted the running cell %s: %d workers", name, len(found))
    return RunningCell(scheduler, settings, [ref for ref, _ in found], found[0][1])
