"""What the global scheduler reports about a cell: typed, so metrics, health checks,
benchmarks and the autoscaler read fields, not string keys.

The sums (``StepTimes``, ``TransferStats``) only grow: subtract two snapshots for a
window.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from scheduler.protocol import Role, TierStats
from scheduler.serving_stats import ServingStats
from scheduler.tiering import TierUsage


class WorkerState(str, enum.Enum):
    """Where a worker is in its life on a cell."""

    SERVING = "serving"     # takes new work
    DRAINING = "draining"   # takes none; its prefills finish, its decodes move to peers
    REMOVED = "removed"     # drained and gone
    LOST = "lost"           # died, or failed a step

    def __str__(self) -> str:
        return self.value


@dataclass
class LatencyWindow:
    """Latency samples of the last ``window_s`` seconds: the autoscaler's view of the
    service level now, not since the start."""

    def __init__(self, window_s: float = 10.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))

    def mean(self, now: float) -> float | None:
        """The mean of the window's samples; None without any."""
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        if not self._samples:
            return None
        return sum(v for _, v in self._samples) / len(self._samples)


@dataclass
class TransferStats:
    """KV handoffs of one worker; ``seconds`` from the first token to the receiver's
    acknowledgement, of which ``export_seconds`` until the sender's batch was ready.
    ``pushes`` and the other ``push`` fields: transfers of a prompt's finished blocks
    ahead of its handoff, while it still prefilled (``scheduler.prefix_push``), counted
    apart from the handoffs."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    export_seconds: float = 0.0
    failures: int = 0
    transports: dict[str, int] = field(default_factory=dict)   # handoffs per transport
    pushes: int = 0
    pushed_bytes: int = 0
    push_seconds: float = 0.0
    push_failures: int = 0


@dataclass
class StepTimes:
    """Where the time of a worker's steps went, summed over its steps."""

    steps: int = 0
    plan_s: float = 0.0      # schedule() and msgpack encode
    rpc_s: float = 0.0       # the worker call, less the worker's own execute time
    execute_s: float = 0.0   # the worker's step
    update_s: float = 0.0    # msgpack decode, scheduler update and publishing
    last_step_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.plan_s + self.rpc_s + self.execute_s + self.update_s


@dataclass
class WorkerReport:
    """One worker's pool, queue, step-time, prefix-cache and transfer figures."""

    worker_id: str
    role: Role
    state: WorkerState
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_running: int
    num_waiting: int
    worker_num_seqs: int   # sequences the worker itself holds, after its last step
    prefix_hit_rate: float
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    step_times: StepTimes = field(default_factory=StepTimes)
    kv_sent: TransferStats = field(default_factory=TransferStats)
    kv_received: TransferStats = field(default_factory=TransferStats)
    queued_prefill_tokens: int = 0   # prompt tokens it has yet to prefill
    tiers: TierUsage | None = None        # None when long contexts are off
    tier_stats: TierStats | None = None

    @property
    def alive(self) -> bool:
        """Serving or draining: its actor answers."""
        return self.state in (WorkerState.SERVING, WorkerState.DRAINING)

    @property
    def num_steps(self) -> int:
        return self.step_times.steps

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / max(self.num_blocks, 1)

    @property
    def mean_step_s(self) -> float:
        return self.step_times.total_s / max(self.step_times.steps, 1)

    @property
    def mean_execute_s(self) -> float:
        return self.step_times.execute_s / max(self.step_times.steps, 1)


@dataclass
class PoolReport:
    """One worker pool as the cell's pool manager keeps it (``cluster``), reported here
    so that metrics read it with the rest of the cell."""

    role: Role
    target: int      # workers it should have
    serving: int     # joined and not draining
    pending: int     # launched, not joined yet (loading, or waiting for resources)
    draining: int
    min_workers: int
    max_workers: int
    scale_ups: int = 0
    scale_downs: int = 0
    last_reason: str = ""   # why the last scaling decision was made


@dataclass
class CellStats:
    """The whole cell: its workers (lost and removed ones included) and its requests."""

    workers: list[WorkerReport]
    num_requests: int
    num_waiting: int
    num_handoffs: int      # sequences whose KV is moving between workers now
    num_recovered: int     # sequences recomputed after a loss or a failed handoff
    num_migrated: int = 0  # running sequences moved off a draining worker by KV handoff
    ttft_s: float | None = None   # mean time to first token over the recent window
    tpot_s: float | None = None   # mean time per output token over the recent window
    pools: list[PoolReport] = field(default_factory=list)
    serving: ServingStats = field(default_factory=ServingStats)   # request-level totals
    recovering: bool = False   # restarted, not yet serving: taking over its workers

    def live(self, role: Role | None = None) -> list[WorkerReport]:
        """The workers whose actors answer, of ``role`` if given."""
        return [w for w in self.workers if w.alive and (role is None or w.role == role)]

    def worker(self, worker_id: str) -> WorkerReport:
        return next(w for w in self.workers if w.worker_id == worker_id)
