"""One worker as the global scheduler keeps it: its handle, the batch scheduler that
mirrors its pool, its state on the cell and the figures it reports."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.batch_scheduler import BatchScheduler
from scheduler.config import CellConfig
from scheduler.protocol import Role, TierStats
from scheduler.stats import StepTimes, TransferStats, WorkerReport, WorkerState
from scheduler.tiering import TierPlanner
from scheduler.worker_handle import WorkerHandle, WorkerRef


@dataclass(eq=False)
class CellWorker:
    ref: WorkerRef
    batch: BatchScheduler
    state: WorkerState = WorkerState.SERVING
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    times: StepTimes = field(default_factory=StepTimes)
    sent: TransferStats = field(default_factory=TransferStats)
    received: TransferStats = field(default_factory=TransferStats)
    reported_seqs: int = 0   # sequences the worker itself holds, after its last step
    tier_stats: TierStats | None = None   # its host tier and recalls (long contexts)
    outgoing: int = 0        # handoffs from it still moving
    gone: asyncio.Event = field(default_factory=asyncio.Event)   # set once removed or lost

    @classmethod
    def join(cls, ref: WorkerRef, config: CellConfig) -> CellWorker:
        """A worker's scheduler-side mirror: an empty pool of its size."""
        kv = KVCacheManager(ref.num_blocks, config.block_size, config.enable_prefix_caching)
        lc = config.long_context
        tiers = TierPlanner(lc, kv, ref.host_blocks) if lc is not None and lc.enabled else None
        return cls(ref, BatchScheduler(config.batch, kv, config.max_model_len,
                                       config.eos_token_ids, tiers))

    @property
    def worker_id(self) -> str:
        return self.ref.worker_id

    @property
    def role(self) -> Role:
        return self.ref.role

    @property
    def handle(self) -> WorkerHandle:
        return self.ref.handle

    @property
    def kv(self) -> KVCacheManager:
        return self.batch.kv

    @property
    def alive(self) -> bool:
        """Its actor answers (serving or draining)."""
        return self.state in (WorkerState.SERVING, WorkerState.DRAINING)

    @property
    def serving(self) -> bool:
        """It takes new work."""
        return self.state is WorkerState.SERVING

    def report(self) -> WorkerReport:
        pool = self.kv.pool
        return WorkerReport(
            self.worker_id, self.role, self.state, pool.num_blocks, pool.num_free_blocks,
            pool.num_used_blocks, self.batch.num_running, self.batch.num_waiting,
            self.reported_seqs, self.kv.stats.hit_rate, self.kv.stats.queried_tokens,
            self.kv.stats.hit_tokens, self.batch.num_preemptions,
            self.batch.num_recomputed_tokens, copy.deepcopy(self.times),
            copy.deepcopy(self.sent), copy.deepcopy(self.received),
            queued_prefill_tokens(self),
            self.batch.tiers.usage() if self.batch.tiers else None, self.tier_stats)


def queued_prefill_tokens(w: CellWorker) -> int:
    """Prompt tokens (or tokens to recompute) a worker has yet to prefill."""
    left = (s.num_tokens - s.num_computed_tokens for s in w.batch.seqs.values())
    return sum(n for n in left if n > 1)


def num_decoding(w: CellWorker) -> int:
    """Sequences past their prefill on a worker (one token to run per step)."""
    return sum(1 for s in w.batch.seqs.values() if s.num_tokens - s.num_computed_tokens <= 1)
