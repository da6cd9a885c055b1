"""The global scheduler as Ray runs it: a named, detached actor that Ray restarts when
its process dies.

Ray re-runs a restarted actor's constructor with its first arguments: the workers the
cell started with, some of which may be gone by then, and none of which would forget
the sequences the dead scheduler gave it. So a restarted scheduler starts empty and
``recovering``; the cell's pool manager, which knows the live workers, hands them over
(``GlobalScheduler.adopt``), and the routers resubmit their requests.
"""

from __future__ import annotations

from typing import Any

import ray

from scheduler.config import CellConfig
from scheduler.global_scheduler import GlobalScheduler
from scheduler.worker_handle import WorkerRef

NAMESPACE = "llm-cluster"  # where the named schedulers live, whatever the driver's namespace
OPTIONS: dict[str, Any] = {"lifetime": "detached", "num_cpus": 0, "max_concurrency": 10_000,
                           "max_restarts": -1, "max_task_retries": 0}


class SchedulerActor(GlobalScheduler):
    def __init__(self, workers: list[WorkerRef], config: CellConfig) -> None:
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        super().__init__([] if restarted else workers, config, recovering=restarted)


def scheduler_name(cluster_name: str) -> str:
    """The name the scheduler of the cell ``cluster_name`` goes by in ``NAMESPACE``."""
    return f"llm-scheduler-{cluster_name}"


def launch(name: str, namespace: str, workers: list[WorkerRef], config: CellConfig) -> Any:
    """Start the scheduler actor ``name`` (a ``ValueError`` if one of that name runs)."""
    return ray.remote(SchedulerActor).options(name=name, namespace=namespace,
                                              **OPTIONS).remote(workers, config)
