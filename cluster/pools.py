"""The worker actors of a running cell, by pool: add, drain, replace.

A background thread keeps each pool at its target count: a worker that died is
replaced after a backoff that doubles with every consecutive failure of its pool;
a scheduler that Ray restarted (its process died) is handed the serving workers.
Workers are named actors, detached when the cell must outlive the process that launched
them (the ``LLMCell`` replica): a restarted owner finds them by name (``find_named``);
a launched worker joins the scheduler only once it has loaded the model, so one whose
resources Ray cannot grant yet (a node still coming up) waits as a pending launch
while the others serve. Removing a worker drains it first (see
``GlobalScheduler.drain``), then its actor goes. The autoscaler moves the targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.config import WorkerPoolConfig
from cluster.ray_worker import RayWorkerHandle
from scheduler.protocol import Role
from scheduler.stats import CellStats, PoolReport, WorkerState
from scheduler.worker_handle import WorkerRef
from workers.worker import Worker, WorkerInfo, WorkerSpec

log = logging.getLogger(__name__)

_TICK_S = 0.5
_MAX_BACKOFF_S = 60.0


@dataclass
class Launch:
    """A worker actor started but not yet serving: loading, or waiting for resources."""

    worker_id: str
    pool: int
    actor: Any
    info_ref: Any
    started: float


@dataclass
class Member:
    worker_id: str
    pool: int
    actor: Any
    ref: WorkerRef   # how it joined the scheduler: handed again to a restarted one
    draining: bool = False


def worker_name(cell: str, worker_id: str) -> str:
    """The Ray name of a worker of the cell ``cell``."""
    return f"llm-worker:{cell}:{worker_id}"


class WorkerPools:
    def __init__(self, spec: WorkerSpec, pools: list[WorkerPoolConfig], backoff_s: float,
                 cell: str, namespace: str, detached: bool = False) -> None:
        """``cell``, ``namespace``: where the workers' names live (see ``worker_name``);
        ``detached``: the workers outlive this process."""
        self.spec = spec
        self.cell, self.namespace, self.detached = cell, namespace, detached
        self.pools = pools
        self.backoff_s = backoff_s
        self.scheduler: Any = None   # set by ``serve``
        self.fingerprint = ""
        self.block_size = 0
        self.min_blocks = 0
        self.targets = [p.count for p in pools]
        self.decisions = [(0, 0, "")] * len(pools)   # (ups, downs, last reason) per pool
        self.workers: dict[str, Any] = {}   # worker id -> actor, every live actor
        self.members: dict[str, Member] = {}
        self.launches: dict[str, Launch] = {}
        self.first_step_at: dict[str, float] = {}   # when a launch joined (monotonic)
        self._failures = Counter[int]()
        self._not_before = [0.0] * len(pools)
        self._ids = Counter[Role]()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- start -----------------------------------------------------------------------
    def launch_initial(self) -> list[tuple[str, int, Any]]:
        """Every pool's first workers, not yet joined: (worker id, pool, actor)."""
        started = []
        for i, pool in enumerate(self.pools):
            for _ in range(pool.count):
                wid = self._next_id(pool.role)
                actor = self._actor(pool, wid)
                self.workers[wid] = actor
                started.append((wid, i, actor))
        return started

    def serve(self, scheduler: Any, started: list[tuple[str, int, Any]], refs: list[WorkerRef],
              fingerprint: str, block_size: int, min_blocks: int) -> None:
        """The first workers have joined ``scheduler`` (as ``refs``, in ``started``'s
        order): tend the pools from now on.
        A worker joining later must have loaded ``fingerprint`` and hold ``min_blocks``
        blocks of ``block_size`` tokens (the cell's context length was settled on them)."""
        self.scheduler, self.fingerprint = scheduler, fingerprint
        self.block_size, self.min_blocks = block_size, min_blocks
        for (wid, pool, actor), ref in zip(started, refs, strict=True):
            self.members[wid] = Member(wid, pool, actor, ref)
            self.workers[wid] = actor
            self._skip_id(wid)
        self._thread = threading.Thread(target=self._run, name="worker-pools", daemon=True)
        self._thread.start()

    def find_named(self, timeout_s: float) -> list[tuple[WorkerRef, WorkerInfo]]:
        """The live workers of this cell that an owner which died left running, found by
        name; each that does not answer with its info within ``timeout_s`` (still
        loading, or broken) is stopped. Later launches take ids none of them had."""
        found = []
        prefix = worker_name(self.cell, "")
        for name in ray.util.list_named_actors(all_namespaces=True):
            if name["namespace"] != self.namespace or not name["name"].startswith(prefix):
                continue
            wid = name["name"][len(prefix):]
            self._skip_id(wid)
            try:
                actor = ray.get_actor(name["name"], namespace=self.namespace)
                info: WorkerInfo = ray.get(actor.info.remote(), timeout=timeout_s)
                role = Role.parse(wid.rpartition("-")[0])
            except ValueError:   # gone meanwhile
                continue
            except (RayActorError, RayTaskError, ray.exceptions.GetTimeoutError) as e:
                log.warning("worker %s left by the cell's last owner is stopped: %s", wid, e)
                ray.kill(actor)
                continue
            found.append((WorkerRef(wid, role, RayWorkerHandle(actor), info.num_blocks,
                                    info.host_blocks, info.place), info))
        return found

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def kill_all(self) -> None:
        with self._lock:
            for actor in self.workers.values():
                ray.kill(actor)
            self.workers.clear()
            self.members.clear()
            self.launches.clear()

    # ---- changes ---------------------------------------------------------------------
    def pool_of(self, role: Role) -> int:
        """The first pool of ``role``."""
        for i, p in enumerate(self.pools):
            if p.role is role:
                return i
        raise ValueError(f"role: no pool of role {role.value!r} in cluster.pools "
                         f"(roles: {', '.join(p.role.value for p in self.pools)})")

    def add(self, role: Role, reason: str = "asked") -> str:
        """Launch one more worker of ``role``'s pool (its target grows by one); returns
        its id. It joins in the background once loaded."""
        with self._lock:
            pool = self.pool_of(role)
            self.targets[pool] += 1
            ups, downs, _ = self.decisions[pool]
            self.decisions[pool] = (ups + 1, downs, reason)
            return self._launch(pool)

    def remove(self, worker_id: str, reason: str = "asked") -> None:
        """Take one worker out (its pool's target shrinks by one): a pending launch is
        cancelled, a serving worker drains in the background and then its actor goes."""
        with self._lock:
            launch = self.launches.pop(worker_id, None)
            member = self.members.get(worker_id)
            if launch is None and (member is None or member.draining):
                raise ValueError(f"worker {worker_id!r} is not a serving worker of this "
                                 f"cell (serving: {', '.join(self._serving_ids())})")
            pool = launch.pool if launch is not None else member.pool
            self.targets[pool] -= 1
            ups, downs, _ = self.decisions[pool]
            self.decisions[pool] = (ups, downs + 1, reason)
            if launch is not None:
                ray.kill(self.workers.pop(worker_id))
                return
            member.draining = True
        threading.Thread(target=self._drain, args=(member,), daemon=True).start()

    def status(self) -> list[PoolReport]:
        with self._lock:
            out = []
            for i, pool in enumerate(self.pools):
                members = [m for m in self.members.values() if m.pool == i]
                out.append(PoolReport(pool.role, self.targets[i],
                                      sum(not m.draining for m in members),
                                      sum(x.pool == i for x in self.launches.values()),
                                      sum(m.draining for m in members), *pool.bounds,
                                      *self.decisions[i]))
            return out

    def pending_ids(self, role: Role) -> list[str]:
        """The launched, not yet joined workers of ``role``, oldest first."""
        with self._lock:
            return [x.worker_id for x in self.launches.values()
                    if self.pools[x.pool].role is role]

    def serving_ids(self, role: Role) -> list[str]:
        """The serving (joined, not draining) workers of ``role``."""
        with self._lock:
            return sorted(m.worker_id for m in self.members.values()
                          if not m.draining and self.pools[m.pool].role is role)

    def wait_joined(self, worker_id: str, timeout_s: float) -> None:
        """Block until a launched worker serves (raises ``TimeoutError`` otherwise)."""
        deadline = time.monotonic() + timeout_s
        while worker_id not in self.members:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker_id!r} did not join within {timeout_s} s")
            time.sleep(0.1)

    def wait_gone(self, worker_id: str, timeout_s: float) -> None:
        """Block until a worker's actor is gone (drained, or lost and dropped)."""
        deadline = time.monotonic() + timeout_s
        while worker_id in self.workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker_id!r} still runs after {timeout_s} s")
            time.sleep(0.1)

    # ---- the background thread -------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self.tick(ray.get(self.scheduler.stats.remote(), timeout=30))
            except Exception:   # keep the cell's pools tended whatever one round met
                log.exception("worker pools: a round failed")

    def tick(self, stats: CellStats) -> None:
        """Hand a restarted scheduler the serving workers; drop lost workers, join loaded
        launches, and launch up to every target."""
        now = time.monotonic()
        with self._lock:
            if stats.recovering:
                refs = [m.ref for m in self.members.values() if not m.draining]
                ray.get(self.scheduler.adopt.remote(refs))
                log.warning("the scheduler restarted: handed it %d workers", len(refs))
            for w in stats.workers:
                member = self.members.get(w.worker_id)
                if w.state is WorkerState.LOST and member is not None:
                    self._drop(member, now, "lost")
            self._join_ready(now)
            for i in range(len(self.pools)):
                have = sum(m.pool == i and not m.draining for m in self.members.values()) + \
                    sum(x.pool == i for x in self.launches.values())
                for _ in range(self.targets[i] - have):
                    if now < self._not_before[i]:
                        break
                    self._launch(i)
            self.scheduler.report_pools.remote(self.status())

    def _join_ready(self, now: float) -> None:
        refs = [x.info_ref for x in self.launches.values()]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_ids = {r.hex() for r in ready}
        for launch in [x for x in self.launches.values() if x.info_ref.hex() in ready_ids]:
            del self.launches[launch.worker_id]
            try:
                info: WorkerInfo = ray.get(launch.info_ref)
                self._check(info)
                ref = WorkerRef(launch.worker_id, self.pools[launch.pool].role,
                                RayWorkerHandle(launch.actor), info.num_blocks,
                                info.host_blocks, info.place)
                ray.get(self.scheduler.add_worker.remote(ref))
            except (RayActorError, RayTaskError, ValueError) as e:
                log.warning("worker %s could not join: %s", launch.worker_id, e)
                ray.kill(self.workers.pop(launch.worker_id))
                self._failed(launch.pool, now)
                continue
            self.members[launch.worker_id] = Member(launch.worker_id, launch.pool,
                                                    launch.actor, ref)
            self.first_step_at[launch.worker_id] = time.monotonic()
            self._failures[launch.pool] = 0
            log.info("worker %s joined after %.1f s", launch.worker_id, now - launch.started)

    def _check(self, info: WorkerInfo) -> None:
        if info.fingerprint != self.fingerprint:
            raise ValueError(f"it loaded model {info.fingerprint}, the cell serves "
                             f"{self.fingerprint}; every worker must see the same files")
        if info.block_size != self.block_size:
            raise ValueError(f"its KV blocks hold {info.block_size} tokens, the cell's "
                             f"{self.block_size}; set cache.block_size")
        if info.num_blocks < self.min_blocks:
            raise ValueError(f"its KV pool holds {info.num_blocks} blocks, the cell's "
                             f"context length needs {self.min_blocks}; give it more memory")

    def _drop(self, member: Member, now: float, why: str) -> None:
        del self.members[member.worker_id]
        actor = self.workers.pop(member.worker_id, None)
        if actor is not None:
            ray.kill(actor)
        if why == "lost" and not member.draining:
            self._failed(member.pool, now)
            log.warning("worker %s lost: a replacement starts in %.1f s", member.worker_id,
                        self._not_before[member.pool] - now)

    def _failed(self, pool: int, now: float) -> None:
        delay = min(self.backoff_s * 2 ** self._failures[pool], _MAX_BACKOFF_S)
        self._failures[pool] += 1
        self._not_before[pool] = now + delay

    def _drain(self, member: Member) -> None:
        try:
            state = ray.get(self.scheduler.drain.remote(member.worker_id))
        except Exception as e:
            log.warning("draining worker %s failed (%s); stopping it", member.worker_id, e)
            state = WorkerState.LOST
        with self._lock:
            if member.worker_id in self.members:
                self._drop(member, time.monotonic(), str(state))

    def _launch(self, pool: int) -> str:
        wid = self._next_id(self.pools[pool].role)
        actor = self._actor(self.pools[pool], wid)
        self.workers[wid] = actor
        self.launches[wid] = Launch(wid, pool, actor, actor.info.remote(), time.monotonic())
        log.info("launching worker %s", wid)
        return wid

    def _actor(self, pool: WorkerPoolConfig, worker_id: str) -> Any:
        """One worker actor with the pool's resources and torch threads, named."""
        lifetime = "detached" if self.detached else None
        # Resources given to ray.remote, not .options(): Ray reads enable_tensor_transport
        # from the class only.
        return ray.remote(**worker_options(pool, self.spec.device))(Worker).options(
            name=worker_name(self.cell, worker_id), namespace=self.namespace,
            lifetime=lifetime).remote(
            dataclasses.replace(self.spec, num_threads=pool.threads), pool.role)

    def _next_id(self, role: Role) -> str:
        n = self._ids[role]
        self._ids[role] += 1
        return f"{role}-{n}"

    def _skip_id(self, worker_id: str) -> None:
        """Launch no worker under ``worker_id`` (one of a previous owner's)."""
        role, _, n = worker_id.rpartition("-")
        with contextlib.suppress(ValueError):
            self._ids[Role(role)] = max(self._ids[Role(role)], int(n) + 1)

    def _serving_ids(self) -> list[str]:
        return sorted(m.worker_id for m in self.members.values() if not m.draining)


def worker_options(pool: WorkerPoolConfig, device: str) -> dict[str, Any]:
    """Ray actor options for one worker of ``pool``. A worker on ``device: npu`` holds one
    NPU (``{"NPU": 1}`` unless the pool names another amount): Ray then places it on a
    node with a free NPU and sets ``ASCEND_RT_VISIBLE_DEVICES`` to it. Accelerator
    workers may send block tensors by a Ray Direct Transport (``tensor_transport``)."""
    resources = dict(pool.resources)
    if device == "npu":
        resources.setdefault("NPU", 1.0)
    options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 0),
                               "num_gpus": resources.pop("GPU", 0), "max_restarts": 0}
    if device in ("cuda", "npu"):   # device-to-device handoffs (Ray Direct Transport)
        options["enable_tensor_transport"] = True
    if resources:
        options["resources"] = resources
    return options
