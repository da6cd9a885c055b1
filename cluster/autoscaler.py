"""The autoscaler: each pool's size from its own load signals.

``ScalingPolicy`` is pure (signals and a clock in, decisions out), so its hysteresis,
delays and bounds are tested with synthetic signals. ``Autoscaler`` feeds it the
cell's stats on a thread and carries its decisions out through ``WorkerPools``: a new
worker asks Ray for its pool's resources (so on a cluster the Ray autoscaler, and
KubeRay, add a node when none has room), and the capacity of every pool's target is
requested ahead through ``request_resources``, so nodes come up while the worker is
still being placed rather than after.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from cluster.config import AutoscaleConfig
from cluster.pools import WorkerPools
from scheduler.protocol import Role
from scheduler.stats import CellStats, WorkerState

log = logging.getLogger(__name__)

_PREFILL_SIGNALS = (Role.PREFILL, Role.MIXED)
_DECODE_SIGNALS = (Role.DECODE, Role.MIXED)


@dataclass
class PoolLoad:
    """One pool's signals at one moment."""

    role: Role
    workers: int                 # serving plus pending: what the pool has asked for
    min_workers: int
    max_workers: int
    queued_prefill_tokens: int   # over its serving workers
    running_seqs: int
    kv_usage: float              # used blocks over all blocks of its serving workers
    ttft_s: float | None         # the cell's recent means (None: no sample)
    tpot_s: float | None


@dataclass
class Decision:
    role: Role
    delta: int    # +1 grow, -1 shrink
    reason: str


class ScalingPolicy:
    """Decides, per pool, whether to grow or shrink by one worker now."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._last_up: dict[Role, float] = {}
        self._low_since: dict[Role, float] = {}

    def decide(self, now: float, loads: list[PoolLoad]) -> list[Decision]:
        decisions = []
        for load in loads:
            d = self._decide(now, load)
            if d is not None:
                decisions.append(d)
        return decisions

    def _decide(self, now: float, load: PoolLoad) -> Decision | None:
        c, role, n = self.config, load.role, load.workers
        if n < load.min_workers:
            return self._up(now, role, f"{n} workers < min_workers {load.min_workers}")
        if n > load.max_workers:
            return self._down(role, f"{n} workers > max_workers {load.max_workers}")
        over = [f"{name} {value:.3g} > {limit:.3g}"
                for name, value, limit in self.signals(load, n) if value > limit]
        if over:
            self._low_since.pop(role, None)
            if n >= load.max_workers or now - self._last_up.get(role, -1e18) < \
                    c.scale_up_cooldown_s:
                return None
            return self._up(now, role, "; ".join(over))
        if n <= load.min_workers:
            self._low_since.pop(role, None)
            return None
        # Hysteresis: shrink only if one worker fewer would stay well under every limit.
        fewer = self.signals(load, n - 1)
        if any(value >= c.scale_down_fraction * limit for _, value, limit in fewer):
            self._low_since.pop(role, None)
            return None
        since = self._low_since.setdefault(role, now)
        if now - since < c.scale_down_delay_s or \
                now - self._last_up.get(role, -1e18) < c.scale_down_delay_s:
            return None
        return self._down(role, f"low load for {now - since:.0f} s with {n - 1} workers: "
                          + ", ".join(f"{name} {v:.3g}" for name, v, _ in fewer))

    def signals(self, load: PoolLoad, workers: int) -> list[tuple[str, float, float]]:
        """(name, value, limit) of each signal of the pool's role, per-worker loads
        spread over ``workers`` (latencies as measured)."""
        c, per = self.config, max(load.workers, 1) / max(workers, 1)
        out = []
        if load.role in _PREFILL_SIGNALS:
            out.append(("queued_prefill_tokens/worker",
                        load.queued_prefill_tokens / max(workers, 1), c.queued_prefill_tokens))
            out.append(("ttft_s", load.ttft_s or 0.0, c.ttft_target_s))
        if load.role in _DECODE_SIGNALS:
            out.append(("kv_usage", load.kv_usage * per, c.kv_usage_high))
            out.append(("running_seqs/worker", load.running_seqs / max(workers, 1),
                        c.running_seqs_high))
            out.append(("tpot_s", load.tpot_s or 0.0, c.tpot_target_s))
        return out

    def _up(self, now: float, role: Role, reason: str) -> Decision:
        self._last_up[role] = now
        self._low_since.pop(role, None)
        return Decision(role, +1, reason)

    def _down(self, role: Role, reason: str) -> Decision:
        self._low_since.pop(role, None)
        return Decision(role, -1, reason)


def pool_loads(stats: CellStats) -> list[PoolLoad]:
    """The policy's signals from the cell's stats (its ``pools`` included)."""
    loads = []
    for pool in stats.pools:
        serving = [w for w in stats.live(pool.role) if w.state is WorkerState.SERVING]
        blocks = sum(w.num_blocks for w in serving)
        loads.append(PoolLoad(
            pool.role, pool.serving + pool.pending, pool.min_workers, pool.max_workers,
            sum(w.queued_prefill_tokens for w in serving),
            sum(w.num_running for w in serving),
            sum(w.num_used_blocks for w in serving) / blocks if blocks else 0.0,
            stats.ttft_s, stats.tpot_s))
    return loads


class Autoscaler:
    """Runs the policy every ``interval_s`` on a thread and applies its decisions."""

    def __init__(self, scheduler: Any, pools: WorkerPools, config: AutoscaleConfig) -> None:
        self.scheduler = scheduler
        self.pools = pools
        self.config = config
        self.policy = ScalingPolicy(config)
        self.decisions: list[tuple[float, Decision]] = []   # (monotonic time, decision)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.tick(ray.get(self.scheduler.stats.remote(), timeout=30))
            except Exception:   # one bad round must not end autoscaling
                log.exception("autoscaler: a round failed")

    def tick(self, stats: CellStats) -> None:
        if stats.recovering:   # a restarted scheduler knows no worker until it adopts them
            return
        now = time.monotonic()
        stats.pools = self.pools.status()   # fresher than the scheduler's copy
        scalable = {p.role for p in self.pools.pools if p.bounds[0] < p.bounds[1]}
        loads = [x for x in pool_loads(stats) if x.role in scalable]
        decisions = self.policy.decide(now, loads)
        for d in decisions:
            self._apply(d, stats)
            self.decisions.append((now, d))
        if any(d.delta > 0 for d in decisions):
            self._request_capacity()

    def _apply(self, d: Decision, stats: CellStats) -> None:
        if d.delta > 0:
            wid = self.pools.add(d.role, d.reason)
            log.info("autoscaler: %s pool grows (%s): launching %s", d.role, d.reason, wid)
            return
        pending = self.pools.pending_ids(d.role)
        serving = self.pools.serving_ids(d.role)
        if pending:   # a worker still loading goes first: nothing runs on it
            victim = pending[-1]
        elif serving:   # else the serving worker with the fewest sequences to move
            running = {w.worker_id: w.num_running + w.num_waiting for w in stats.workers}
            victim = min(serving, key=lambda wid: (running.get(wid, 0), wid))
        else:
            return
        log.info("autoscaler: %s pool shrinks (%s): removing %s", d.role, d.reason, victim)
        self.pools.remove(victim, d.reason)

    def _request_capacity(self) -> None:
        """Ask the Ray autoscaler for room for every pool's target at once."""
        from ray.autoscaler.sdk import request_resources

        bundles = [dict(p.resources) for p, target in zip(self.pools.pools,
                                                          self.pools.targets)
                   for _ in range(target)]
        try:
            request_resources(bundles=bundles)
        except Exception as e:   # no autoscaler on this Ray instance: nothing to ask
            log.debug("request_resources: %s", e)
