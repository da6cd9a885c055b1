"""The global scheduler: one per model ("cell"), owning every request and every worker's batch.

Each worker gets its own ``BatchScheduler`` over a ``KVCacheManager`` that mirrors the
worker's pool, and its own asyncio step loop, so a slow worker never stalls the
others. Plans and outputs cross as msgpack bytes. Placement: a new request goes to
the least-loaded prefill worker, preferring one whose prefix cache holds its leading
blocks; prompts shorter than ``prefill_threshold`` go to a decode worker directly, and
so does a prompt that would wait longer behind a prefill backlog of more than
``max_prefill_queue_tokens`` than it stalls the decode worker's sequences
(conditional disaggregation by length and load).
A sequence whose prefill sampled its first token on a prefill worker moves to the
decode worker with the most free blocks: the decode side reserves blocks (reusing
its own prefix cache), the prefill side exports only the rest as an Arrow KV batch
through the transport the two workers share (``kvcache.kv_transport``: shared memory on
one node, else the Ray object store), the decode side imports it, and only then does the
prefill side free the blocks (they stay in its prefix cache). A lost worker's
sequences, and any failed, refused or timed-out transfer, are recomputed from the
prompt plus the tokens already produced, so callers never see repeated text.

The class is plain asyncio; ``cluster`` runs it as a named, detached async Ray actor.
It holds no tensor: workers are reached only through their actor handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from kvcache.block_hash import extend_block_hashes
from kvcache.kv_cache_manager import KVCacheManager
from kvcache.kv_transport import HandoffInfo, WorkerPlace, plan_handoff
from kvcache.long_context import LongContextConfig
from scheduler.batch_scheduler import BatchScheduler
from scheduler.config import SchedulerConfig
from scheduler.protocol import SamplingParams, StepOutput, TierStats, decode, encode
from scheduler.sequence import SeqStatus, Sequence, SeqUpdate
from scheduler.serving_stats import RequestTimes, ServingStats
from scheduler.tiering import TierPlanner

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # an idle loop re-plans (and pings its worker) at least this often
_PING_TIMEOUT_S = 30.0


class OverloadedError(RuntimeError):
    """The waiting queue is full: the submission is refused at once; retry later."""


class NoWorkersError(RuntimeError):
    """No live worker is left to run a request."""


@dataclass
class WorkerRef:
    """A worker as the scheduler sees it: an id, a role and its actor handle."""

    worker_id: str
    role: str
    actor: Any
    num_blocks: int
    host_blocks: int = 0   # its host tier (long contexts)
    place: WorkerPlace | None = None   # where its pool is: picks the KV transport


@dataclass
class TransferStats:
    """KV handoffs of one worker; ``seconds`` from the first token to the receiver's
    acknowledgement, of which ``export_seconds`` until the sender's batch was ready."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    export_seconds: float = 0.0
    failures: int = 0
    transports: dict[str, int] = field(default_factory=dict)   # handoffs per transport


@dataclass
class StepTimes:
    """Where the time of a worker's steps went, summed over its steps."""

    steps: int = 0
    plan_s: float = 0.0      # schedule() and msgpack encode
    rpc_s: float = 0.0       # the actor call, less the worker's own execute time
    execute_s: float = 0.0   # the worker's step
    update_s: float = 0.0    # msgpack decode, scheduler update and publishing
    last_step_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.plan_s + self.rpc_s + self.execute_s + self.update_s


@dataclass(eq=False)
class _Worker:
    ref: WorkerRef
    batch: BatchScheduler
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    alive: bool = True
    times: StepTimes = field(default_factory=StepTimes)
    sent: TransferStats = field(default_factory=TransferStats)
    received: TransferStats = field(default_factory=TransferStats)
    reported_seqs: int = 0   # sequences the worker itself holds, after its last step
    tier_stats: TierStats | None = None   # its host tier and recalls (long contexts)

    @property
    def role(self) -> str:
        return self.ref.role

    @property
    def kv(self) -> KVCacheManager:
        return self.batch.kv


@dataclass(eq=False)
class _Request:
    seq: Sequence
    worker: _Worker | None   # None while its KV is being handed over
    times: RequestTimes
    updates: list[SeqUpdate] = field(default_factory=list)
    done: bool = False
    error: Exception | None = None   # raised to the caller instead of an output


class GlobalScheduler:
    def __init__(self, workers: list[WorkerRef], config: SchedulerConfig, block_size: int,
                 enable_prefix_caching: bool, max_model_len: int, eos_token_ids: list[int],
                 prefill_threshold: int = 0, max_waiting: int = 1024,
                 transfer_timeout_s: float = 30.0,
                 max_prefill_queue_tokens: int | None = None,
                 long_context: LongContextConfig | None = None) -> None:
        if not workers:
            raise ValueError("workers: got none; a cluster needs at least one worker")
        self.block_size = block_size
        self.prefill_threshold = prefill_threshold
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.max_waiting = max_waiting
        self.transfer_timeout_s = transfer_timeout_s
        self.workers = []
        for w in workers:
            kv = KVCacheManager(w.num_blocks, block_size, enable_prefix_caching)
            tiers = (TierPlanner(long_context, kv, w.host_blocks)
                     if long_context is not None and long_context.enabled else None)
            self.workers.append(_Worker(w, BatchScheduler(config, kv, max_model_len,
                                                          eos_token_ids, tiers)))
        self.requests: dict[str, _Request] = {}
        self.clients: dict[str, set[str]] = {}   # client -> its requests still known
        self.num_recovered = 0
        self.serving = ServingStats()
        self._pulse = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start one step loop per worker (needs the running event loop)."""
        for w in self.workers:
            self._spawn(self._loop(w))

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ---- requests --------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int = 0,
                     client: str | None = None) -> None:
        """Queue a request, or raise ``OverloadedError`` at once when the queue is full.
        ``client`` names the caller for ``get_client_updates``."""
        if params.n != 1:
            raise ValueError(f"n: got {params.n}; the cluster runs n=1 only, submit the "
                             "prompt n times with different seeds instead")
        queued = sum(w.batch.num_waiting for w in self.workers if w.alive)
        if queued >= self.max_waiting:
            raise OverloadedError(f"overloaded: {queued} requests are waiting "
                                  f"(cluster.max_waiting={self.max_waiting}); retry later")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        w = self._place(prompt_token_ids)
        if w is None:
            raise NoWorkersError("no live worker is left in this cluster; restart it")
        w.batch.add(request_id, prompt_token_ids, params, priority)
        self.requests[request_id] = _Request(w.batch.seqs[request_id], w,
                                             RequestTimes(time.monotonic()))
        if client is not None:
            self.clients.setdefault(client, set()).add(request_id)
        w.wake.set()

    async def get_updates(self, request_ids: list[str],
                          timeout_s: float = 1.0) -> dict[str, tuple[list[SeqUpdate], bool,
                                                                      Exception | None]]:
        """Wait until one of the requests has news (or the timeout); returns, per request
        with news, (token updates since the last call, finished, the error that ended
        it). A finished request is forgotten once returned."""
        return await self._wait_updates(lambda: request_ids, timeout_s)

    async def get_client_updates(self, client: str, timeout_s: float = 1.0
                                 ) -> dict[str, tuple[list[SeqUpdate], bool, Exception | None]]:
        """``get_updates`` over every live request submitted with ``client``, so one
        long-poll serves all the streams of a router replica, those submitted while
        it waits included."""
        return await self._wait_updates(lambda: self._client_requests(client), timeout_s)

    def _client_requests(self, client: str) -> list[str]:
        live = {rid for rid in self.clients.pop(client, ()) if rid in self.requests}
        if live:
            self.clients[client] = live
        return sorted(live)

    async def _wait_updates(self, request_ids: Callable[[], list[str]], timeout_s: float
                            ) -> dict[str, tuple[list[SeqUpdate], bool, Exception | None]]:
        deadline = time.monotonic() + timeout_s
        while True:
            ready = {}
            for rid in request_ids():
                req = self.requests.get(rid)
                if req is None:
                    ready[rid] = ([], True, KeyError(f"unknown request id {rid!r}: never "
                                                     "submitted, or already finished"))
                elif req.updates or req.done:
                    ready[rid] = (req.updates, req.done, req.error)
                    req.updates = []
                    if req.done:
                        del self.requests[rid]
            left = deadline - time.monotonic()
            if ready or left <= 0:
                return ready
            pulse = self._pulse
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pulse.wait(), left)

    async def abort(self, request_id: str, reason: str = "abort") -> list[SeqUpdate]:
        """Finish a request now and free its blocks wherever they are; returns its
        final update. Aborting an unknown or finished request is a no-op. ``reason``
        is what the metrics count it as: ``stop`` when the caller matched a stop string."""
        req = self.requests.pop(request_id, None)
        if req is None or req.done:
            return []
        self.serving.finish(req.times, reason, time.monotonic())
        if req.worker is not None:
            req.worker.wake.set()
            return req.worker.batch.abort(request_id)
        # Mid-handoff: the transfer task sees the finished status and frees both sides.
        seq = req.seq
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        return [SeqUpdate(request_id, seq.seq_id, seq.sample_index, [], None, "abort")]

    async def record_error(self, kind: str) -> None:
        """Count a request a router refused (by error kind), for the cell's metrics."""
        self.serving.error(kind)

    async def stats(self) -> dict[str, Any]:
        """Per-worker pool, queue, step-time, prefix-cache, preemption and transfer
        figures, and the cell's request-level ``serving`` totals."""
        workers = []
        for w in self.workers:
            t = w.times
            steps = max(t.steps, 1)
            workers.append({
                "worker_id": w.ref.worker_id, "role": w.role, "alive": w.alive,
                "num_blocks": w.kv.pool.num_blocks,
                "num_free_blocks": w.kv.pool.num_free_blocks,
                "num_used_blocks": w.kv.pool.num_used_blocks,
                "num_running": w.batch.num_running, "num_waiting": w.batch.num_waiting,
                "worker_num_seqs": w.reported_seqs,
                "num_steps": t.steps, "last_step_s": t.last_step_s,
                "mean_step_s": t.total_s / steps, "mean_execute_s": t.execute_s / steps,
                "mean_plan_s": t.plan_s / steps, "mean_rpc_s": t.rpc_s / steps,
                "mean_update_s": t.update_s / steps,
                "step_times": asdict(t),   # sums, for windows: subtract two snapshots
                "prefix_hit_rate": w.kv.stats.hit_rate,
                "prefix_queried_tokens": w.kv.stats.queried_tokens,
                "prefix_hit_tokens": w.kv.stats.hit_tokens,
                "num_preemptions": w.batch.num_preemptions,
                "kv_sent": asdict(w.sent), "kv_received": asdict(w.received),
                "tiers": asdict(w.batch.tiers.usage()) if w.batch.tiers else None,
                "tier_stats": asdict(w.tier_stats) if w.tier_stats else None,
            })
        return {"workers": workers,
                "num_requests": len(self.requests),
                "num_waiting": sum(w.batch.num_waiting for w in self.workers if w.alive),
                "num_handoffs": sum(1 for r in self.requests.values() if r.worker is None),
                "num_recovered": self.num_recovered,
                "serving": asdict(self.serving)}

    # ---- step loops ------------------------------------------------------------------
    async def _loop(self, w: _Worker) -> None:
        try:
            await self._steps(w)
        except Exception as e:  # a bug or a broken reply: never leave requests hanging
            log.exception("step loop of worker %s failed", w.ref.worker_id)
            self._lose(w, e)

    async def _steps(self, w: _Worker) -> None:
        while w.alive:
            t0 = time.perf_counter()
            plan = w.batch.schedule()
            if plan.is_empty:
                w.wake.clear()
                try:
                    await asyncio.wait_for(w.wake.wait(), _IDLE_POLL_S)
                except asyncio.TimeoutError:
                    await self._check_alive(w)   # notice the death of an idle worker
                continue
            message = encode(plan)
            t1 = time.perf_counter()
            try:
                reply = await w.ref.actor.step.remote(message)
            except (RayActorError, RayTaskError) as e:
                self._lose(w, e)
                return
            if not w.alive:   # declared lost meanwhile: its sequences run elsewhere now
                return
            t2 = time.perf_counter()
            output = decode(StepOutput, reply)
            updates = w.batch.update(output)
            self._publish(updates)
            if w.role == "prefill":
                for u in updates:   # a prompt's first token: its KV moves on
                    if u.new_token_ids and u.finish_reason is None and u.seq_id in w.batch.seqs:
                        self._start_handoff(w, w.batch.seqs[u.seq_id])
            t3 = time.perf_counter()
            w.reported_seqs = output.stats.num_seqs
            w.tier_stats = output.stats.tier or w.tier_stats
            t = w.times
            t.steps += 1
            t.plan_s += t1 - t0
            t.execute_s += output.stats.step_time_s
            t.rpc_s += (t2 - t1) - output.stats.step_time_s
            t.update_s += t3 - t2
            t.last_step_s = t3 - t0

    def _publish(self, updates: list[SeqUpdate]) -> None:
        now = time.monotonic()
        for u in updates:
            req = self.requests.get(u.request_id)
            if req is None:
                continue
            req.updates.append(u)
            self.serving.tokens(req.times, req.seq.num_prompt_tokens, len(u.new_token_ids),
                                now)
            if u.finish_reason is not None:
                req.done = True
                self.serving.finish(req.times, u.finish_reason, now)
        if updates:
            self._notify()

    def _notify(self) -> None:
        self._pulse.set()
        self._pulse = asyncio.Event()

    # ---- placement -------------------------------------------------------------------
    def _place(self, token_ids: list[int]) -> _Worker | None:
        """Where a prompt (new, or recomputed) is prefilled: by role, then prefix hit, then load.

        Long prompts prefer prefill workers, short ones decode workers (conditional
        disaggregation); a missing role falls back to mixed workers, then the other role.
        While every prefill worker has ``max_prefill_queue_tokens`` or more prompt tokens
        waiting, a long prompt goes to the live worker where it costs least, in token
        times: the prefill work queued there plus its own new tokens, which also stall
        every sequence the worker decodes (a prefill worker decodes none). A burst of
        prompts is then prefilled on idle decode workers too instead of queueing behind one
        prefill worker, while a decode worker busy with many sequences, or a long prompt,
        still goes to the prefill workers.
        """
        alive = [w for w in self.workers if w.alive]
        if len(token_ids) >= self.prefill_threshold:
            order = ("prefill", "mixed", "decode")
        else:
            order = ("decode", "mixed", "prefill")
        by_role = ([w for w in alive if w.role == role] for role in order)
        candidates = next((found for found in by_role if found), [])
        if not candidates:
            return None
        hashes = extend_block_hashes([], token_ids, self.block_size)
        limit = self.max_prefill_queue_tokens
        if (candidates[0].role == "prefill" and limit is not None
                and min(_queued_prefill_tokens(w) for w in candidates) >= limit):
            def cost(w: _Worker) -> int:
                new = len(token_ids) - len(w.kv.pool.lookup(hashes)) * self.block_size
                return _queued_prefill_tokens(w) + new * (1 + _num_decoding(w))

            return min(alive, key=lambda w: (cost(w), w.role != "prefill",
                                             -w.kv.pool.num_free_blocks))
        return min(candidates, key=lambda w: (-len(w.kv.pool.lookup(hashes)),
                                              len(w.batch.seqs), -w.kv.pool.num_free_blocks))

    def _recompute(self, seq: Sequence, target: _Worker | None = None) -> None:
        """Queue a sequence for recomputation on ``target`` (else where ``_place`` says),
        or fail its request when no worker is left."""
        req = self.requests.get(seq.request_id)
        if req is None or seq.is_finished:
            return
        self.num_recovered += 1
        target = target or self._place(seq.token_ids)
        if target is None:
            req.worker = None
            req.done = True
            req.error = NoWorkersError("no live worker is left in this cluster to run the "
                                       "request; restart the cluster")
            self._notify()
            return
        target.batch.adopt(seq, computed=False)
        req.worker = target
        target.wake.set()

    def _lose(self, w: _Worker, error: BaseException) -> None:
        """A worker died (or failed a step): recompute its sequences elsewhere."""
        if not w.alive:
            return
        w.alive = False
        seqs = list(w.batch.seqs.values())
        log.warning("worker %s (%s) lost: %s; recomputing its %d sequences elsewhere",
                    w.ref.worker_id, w.role, error, len(seqs))
        for seq in seqs:
            self._recompute(seq)
        if not any(x.alive for x in self.workers):
            for req in self.requests.values():
                if not req.done:
                    req.done = True
                    req.error = NoWorkersError("every worker of this cluster is lost; "
                                               "restart the cluster")
            self._notify()

    # ---- KV handoff ------------------------------------------------------------------
    def _start_handoff(self, src: _Worker, seq: Sequence) -> None:
        """Move a prefilled sequence to the decode worker with the most free blocks.

        Without a live decode worker with room, the sequence decodes where it is. The
        export is submitted here, before the source's next step, so it never waits
        behind another prefill.
        """
        targets = [w for w in self.workers
                   if w.alive and w is not src and w.role in ("decode", "mixed")]
        if not targets:
            return
        dst = max(targets, key=lambda w: w.kv.pool.num_free_blocks)
        tiers = dst.batch.tiers
        # A sequence that will decode in offload mode sends its middle to the host tier.
        middle = tiers.middle_to_receive(seq.num_computed_tokens + 1) if tiers else None
        reserved = dst.kv.reserve(seq.seq_id, seq.token_ids, seq.num_computed_tokens, middle)
        if reserved is None:
            return
        cached, fresh = reserved
        host = _HostRows(middle[0] - len(cached), tiers.receive(seq.seq_id, middle)) \
            if middle else _HostRows(0, [])
        src.batch.detach(seq.seq_id)
        self.requests[seq.request_id].worker = None
        count = len(fresh) + len(host.block_ids)
        export = self._export(src, dst, seq, len(cached), count) if count else None
        self._spawn(self._hand_off(src, dst, seq, fresh, host, export))

    def _export(self, src: _Worker, dst: _Worker, seq: Sequence, first: int,
                count: int) -> Any:
        """Submit the export of ``count`` blocks from block ``first`` on, through the
        transport the two workers share: refs to its HandoffInfo and its batches."""
        blocks = src.kv.block_ids(seq.seq_id)[first:first + count]
        hashes = src.kv.block_hashes(seq.seq_id)
        n = seq.num_computed_tokens
        counts = [min(self.block_size, n - i * self.block_size)
                  for i in range(first, first + count)]
        block_hashes = [hashes[i] if c == self.block_size and i < len(hashes) else None
                        for i, c in zip(range(first, first + count), counts)]
        plan = plan_handoff(src.ref.place, dst.ref.place, count)
        return src.ref.actor.export_kv.options(num_returns=1 + plan.parts).remote(
            blocks, block_hashes, counts, plan)

    async def _hand_off(self, src: _Worker, dst: _Worker, seq: Sequence, fresh: list[int],
                        host: _HostRows, export: Any) -> None:
        start = time.perf_counter()
        ok = False
        try:
            if export is not None:
                info_ref, *batch_refs = export
                info, exported = await asyncio.wait_for(
                    self._import(dst, fresh, host, info_ref, batch_refs),
                    self.transfer_timeout_s)
                elapsed = time.perf_counter() - start
                for stats in (src.sent, dst.received):
                    stats.count += 1
                    stats.bytes += info.nbytes
                    stats.seconds += elapsed
                    stats.export_seconds += exported - start
                    kind = info.transport.value
                    stats.transports[kind] = stats.transports.get(kind, 0) + 1
            ok = True
        except asyncio.TimeoutError:
            log.warning("KV transfer of %s from %s to %s took over %.1f s: abandoned, "
                        "recomputing", seq.seq_id, src.ref.worker_id, dst.ref.worker_id,
                        self.transfer_timeout_s)
        except Exception as e:   # refused (KVTransferError), a lost actor, anything else
            log.warning("KV transfer of %s from %s to %s failed (%s): recomputing",
                        seq.seq_id, src.ref.worker_id, dst.ref.worker_id, e)
            await self._check_alive(dst)
        if not ok:
            src.sent.failures += 1
            dst.received.failures += 1
        src.kv.free(seq.seq_id)
        src.wake.set()
        if seq.is_finished:   # aborted meanwhile
            _drop_reservation(dst, seq)
            dst.wake.set()
            return
        if ok and dst.alive:
            dst.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            dst.batch.adopt(seq, computed=True)
            self.requests[seq.request_id].worker = dst
        else:
            # Recompute on the decode side when it lives, so a transfer that keeps
            # failing cannot bounce the sequence between prefill and handoff forever.
            _drop_reservation(dst, seq)
            self._recompute(seq, dst if dst.alive else None)
        dst.wake.set()

    @staticmethod
    async def _import(dst: _Worker, fresh: list[int], host: _HostRows, info_ref: Any,
                      batch_refs: list[Any]) -> tuple[HandoffInfo, float]:
        """Once the export is done, import its batches (still in the object store) into
        ``fresh`` and the host rows; returns (the export's info, when it was done)."""
        info = await info_ref
        exported = time.perf_counter()
        await dst.ref.actor.import_kv.remote(batch_refs[0], fresh, host.first_row,
                                             host.block_ids, *batch_refs[1:])
        return info, exported

    async def _check_alive(self, w: _Worker) -> None:
        """Ping a worker; only Ray's word that the actor died makes it lost (a slow
        answer may just be queued behind a long KV import)."""
        try:
            await asyncio.wait_for(w.ref.actor.ping.remote(), _PING_TIMEOUT_S)
        except RayActorError as e:
            self._lose(w, e)
        except asyncio.TimeoutError:
            log.warning("worker %s did not answer a ping within %.0f s", w.ref.worker_id,
                        _PING_TIMEOUT_S)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@dataclass
class _HostRows:
    """Rows of a handoff's batch, from ``first_row`` on, that go to the receiver's host
    tier (``block_ids``), the middle of a sequence arriving in offload mode."""

    first_row: int
    block_ids: list[int]


def _drop_reservation(dst: _Worker, seq: Sequence) -> None:
    """Free what a handoff reserved on the receiver, in both tiers."""
    dst.kv.free(seq.seq_id)
    if dst.batch.tiers is not None:
        dst.batch.tiers.release(seq.seq_id)


def _queued_prefill_tokens(w: _Worker) -> int:
    """Prompt tokens (or tokens to recompute) a worker has yet to prefill."""
    left = (s.num_tokens - s.num_computed_tokens for s in w.batch.seqs.values())
    return sum(n for n in left if n > 1)


def _num_decoding(w: _Worker) -> int:
    """Sequences past their prefill on a worker (one token to run per step)."""
    return sum(1 for s in w.batch.seqs.values() if s.num_tokens - s.num_computed_tokens <= 1)
