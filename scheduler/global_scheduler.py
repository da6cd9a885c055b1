"""The global scheduler: one per model ("cell"), owning every request and every worker's batch.

Each worker gets its own ``BatchScheduler`` over a ``KVCacheManager`` that mirrors the
worker's pool, and its own asyncio step loop, so a slow worker never stalls the
others. Plans and outputs cross as msgpack bytes. Where a prompt goes is
``placement``'s call; a sequence whose prefill sampled its first token on a prefill
worker moves to a decode worker by KV ``handoff``, through the transport the two
workers share (``kvcache.kv_transport``: shared memory on one node, else the Ray object
store). A lost worker's sequences, and any failed, refused or timed-out transfer, are
recomputed from the prompt plus the tokens already produced, so callers never see
repeated text. What callers see of their requests (news, long-polls, client leases,
request-level figures) is ``request_book``'s.

The class is plain asyncio; ``cluster`` runs it as a named, detached async Ray actor
that Ray restarts when its process dies. A restarted scheduler knows no request: it
starts ``recovering``, adopts the cell's live workers (``adopt``: each forgets what it
held, so no block leaks) and then takes the requests the routers resubmit with the
tokens already streamed (``submit``'s ``generated``). A client that stops polling (a
dead router replica) loses its requests (``client_leases``), so none holds blocks. It
holds no tensor and no actor: workers are reached only through ``WorkerHandle``s.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time

from scheduler.cell_worker import CellWorker
from scheduler.config import CellConfig
from scheduler.handoff import Handoff, Outcome
from scheduler.placement import decode_target, place_prompt
from scheduler.prefix_push import PrefixPushes
from scheduler.protocol import Role, SamplingParams, StepOutput, decode, encode
from scheduler.request_book import Request, RequestBook, Updates
from scheduler.sequence import SeqStatus, Sequence, SeqUpdate
from scheduler.stats import CellStats, PoolReport, WorkerState
from scheduler.worker_handle import WorkerLostError, WorkerRef

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # an idle loop re-plans (and pings its worker) at least this often
_PING_TIMEOUT_S = 30.0


class OverloadedError(RuntimeError):
    """The waiting queue is full: the submission is refused at once; retry later."""


class NoWorkersError(RuntimeError):
    """No live worker is left to run a request."""


class GlobalScheduler:
    def __init__(self, workers: list[WorkerRef], config: CellConfig,
                 recovering: bool = False) -> None:
        """``recovering``: a restarted scheduler, without workers until ``adopt``."""
        if not workers and not recovering:
            raise ValueError("workers: got none; a cluster needs at least one worker")
        self.config = config
        self.recovering = recovering
        self.workers = [CellWorker.join(w, config) for w in workers]
        self.book = RequestBook(config.client_lease_s)
        self.num_recovered = 0
        self.num_migrated = 0
        self.pools: list[PoolReport] = []
        self._tasks: set[asyncio.Task] = set()
        self.pushes = (PrefixPushes(config.block_size, config.transfer_timeout_s, self._spawn)
                       if config.prefix_push else None)

    @property
    def requests(self) -> dict[str, Request]:
        """Every request not yet returned finished, by id (the book's)."""
        return self.book.requests

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start one step loop per worker, and the reaper of gone clients (needs the
        running event loop)."""
        for w in self.workers:
            self._spawn(self._loop(w))
        self._spawn(self._reap_clients())

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ---- membership ------------------------------------------------------------------
    async def adopt(self, workers: list[WorkerRef]) -> None:
        """A restarted scheduler takes over the cell's live workers (those not in it
        yet): each first forgets every sequence it held, then serves. Ends recovery."""
        known = {w.worker_id for w in self.workers if w.alive}
        for ref in workers:
            if ref.worker_id in known:
                continue
            w = CellWorker.join(ref, self.config)
            w.batch.reset_worker()
            self.workers.append(w)
            self._spawn(self._loop(w))
        if self.recovering:
            self._spawn(self._reap_clients())
        self.recovering = False
        log.info("adopted %d workers; serving again", len(self.workers))
        self.book.notify()

    async def add_worker(self, ref: WorkerRef) -> None:
        """A worker joins the running cell and takes work from its first step on."""
        if any(w.worker_id == ref.worker_id and w.alive for w in self.workers):
            raise ValueError(f"worker id {ref.worker_id!r} is already in this cell; "
                             "give the new worker another id")
        w = CellWorker.join(ref, self.config)
        self.workers.append(w)
        self._spawn(self._loop(w))
        log.info("worker %s (%s) joined with %d blocks", w.worker_id, w.role, ref.num_blocks)
        self.book.notify()

    async def drain(self, worker_id: str) -> WorkerState:
        """Take a worker out of the cell without failing anything: it takes no new work,
        finishes its prefills, and its running sequences move to serving peers by KV
        handoff (recomputed there only when a handoff fails). Returns once it holds
        nothing (``REMOVED``: its actor may go) or died meanwhile (``LOST``)."""
        w = next((w for w in self.workers if w.worker_id == worker_id and w.alive), None)
        if w is None:
            known = ", ".join(x.worker_id for x in self.workers if x.alive)
            raise ValueError(f"worker {worker_id!r} is not a live worker of this cell "
                             f"(live: {known})")
        if w.serving:
            if not any(x.serving and x is not w for x in self.workers):
                raise ValueError(f"worker {worker_id!r} is the last serving worker of this "
                                 "cell; add another before removing it")
            w.state = WorkerState.DRAINING
            log.info("draining worker %s (%s): %d sequences", worker_id, w.role,
                     len(w.batch.seqs))
            w.wake.set()
        await w.gone.wait()
        return w.state

    def _drain_step(self, w: CellWorker) -> None:
        """Between two steps of a draining worker: move its decoding sequences to peers,
        and leave once it holds nothing."""
        for seq in [s for s in w.batch.running if s.num_tokens - s.num_computed_tokens == 1]:
            self._start_handoff(w, seq, migration=True)
        if not w.batch.seqs and not w.outgoing:
            w.state = WorkerState.REMOVED
            self.workers.remove(w)
            w.gone.set()
            log.info("worker %s (%s) drained and removed", w.worker_id, w.role)

    # ---- requests --------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int = 0,
                     client: str | None = None, sample_index: int = 0,
                     generated: list[int] | None = None) -> None:
        """Queue one choice (``sample_index``) of a request, or raise ``OverloadedError``
        at once when the queue is full. ``client`` names the caller for
        ``get_client_updates``. A request of n choices is n submissions (see
        ``cluster.cluster_client.ClusterClient``), each placed, handed off and migrated
        on its own.
        ``generated``: the tokens its caller already has (a request resumed after the
        scheduler was lost); it goes on from them."""
        if params.n != 1:
            raise ValueError(f"n: got {params.n}; submit each of a request's choices on "
                             "its own, with n=1 and its sample_index")
        if self.recovering:
            raise NoWorkersError("the scheduler restarted and is taking over its workers; "
                                 "retry in a few seconds")
        queued = sum(w.batch.num_waiting for w in self.workers if w.alive)
        limit = self.config.max_waiting
        if queued >= limit and generated is None:   # a resumed request was admitted once
            raise OverloadedError(f"overloaded: {queued} requests are waiting "
                                  f"(cluster.max_waiting={limit}); retry later")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        tokens = [*prompt_token_ids, *(generated or ())]
        w = place_prompt(self.workers, tokens, self.config)
        if w is None:
            raise NoWorkersError("no live worker is left in this cluster; restart it")
        w.batch.add(request_id, prompt_token_ids, params, priority, sample_index,
                    generated or ())
        self.book.add(request_id, w.batch.seqs[request_id], w, client)
        w.wake.set()

    async def get_updates(self, request_ids: list[str], timeout_s: float = 1.0) -> Updates:
        """Wait until one of the requests has news (or the timeout); returns, per request
        with news, (token updates since the last call, finished, the error that ended
        it). A finished request is forgotten once returned."""
        return await self.book.wait(lambda: request_ids, timeout_s)

    async def get_client_updates(self, client: str, timeout_s: float = 1.0) -> Updates:
        """``get_updates`` over every live request submitted with ``client``, so one
        long-poll serves all the streams of a router replica, those submitted while
        it waits included. Raises ``ClientExpiredError`` to a client whose lease ran
        out (see ``client_leases``)."""
        return await self.book.wait_client(client, timeout_s)

    async def _reap_clients(self) -> None:
        """Abort the requests of clients that are gone (a dead router replica's)."""
        lease_s = self.book.leases.lease_s
        while True:
            await asyncio.sleep(lease_s / 4)
            for client, rids in self.book.expire_clients().items():
                log.warning("client %s is gone (no poll for %.0f s): aborting its %d "
                            "requests", client, lease_s, len(rids))
                for rid in rids:
                    await self.abort(rid)

    async def abort(self, request_id: str, reason: str = "abort") -> list[SeqUpdate]:
        """Finish a request now and free its blocks wherever they are; returns its
        final update. Aborting an unknown or finished request is a no-op. ``reason``
        is what the metrics count it as: ``stop`` when the caller matched a stop string."""
        req = self.book.abort(request_id, reason)
        if req is None:
            return []
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
        self.book.serving.error(kind)

    async def stats(self) -> CellStats:
        """Per-worker pool, queue, step-time, prefix-cache, preemption and transfer
        figures, the pools, and the cell's request-level ``serving`` totals."""
        return CellStats([w.report() for w in self.workers], len(self.requests),
                         sum(w.batch.num_waiting for w in self.workers if w.alive),
                         sum(1 for r in self.requests.values() if r.worker is None),
                         self.num_recovered, self.num_migrated,
                         self.book.ttft.mean(time.monotonic()),
                         self.book.tpot.mean(time.monotonic()), list(self.pools),
                         copy.deepcopy(self.book.serving), self.recovering)

    async def settings(self) -> CellConfig:
        """The cell's settings (what a new owner of the running cell goes by)."""
        return self.config

    async def report_pools(self, pools: list[PoolReport]) -> None:
        """The pool manager's latest view of the pools, passed on with ``stats``."""
        self.pools = pools

    # ---- step loops ------------------------------------------------------------------
    async def _loop(self, w: CellWorker) -> None:
        try:
            await self._steps(w)
        except Exception as e:  # a bug or a broken reply: never leave requests hanging
            log.exception("step loop of worker %s failed", w.worker_id)
            self._lose(w, e)

    async def _steps(self, w: CellWorker) -> None:
        while w.alive:
            if w.state is WorkerState.DRAINING:
                self._drain_step(w)
                if not w.alive:
                    return
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
                reply = await w.handle.step(message)
            except WorkerLostError as e:
                self._lose(w, e)
                return
            if not w.alive:   # declared lost meanwhile: its sequences run elsewhere now
                return
            t2 = time.perf_counter()
            output = decode(StepOutput, reply)
            updates = w.batch.update(output)
            self.book.publish(updates)
            if w.role is Role.PREFILL:
                for u in updates:   # a prompt's first token: its KV moves on
                    if u.new_token_ids and u.finish_reason is None and u.seq_id in w.batch.seqs:
                        self._start_handoff(w, w.batch.seqs[u.seq_id])
                if self.pushes is not None:   # the rest may have finished chunks
                    self.pushes.after_step(w, self.workers)
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

    # ---- recovery ------------------------------------------------------------------
    def _recompute(self, seq: Sequence, target: CellWorker | None = None) -> None:
        """Queue a sequence for recomputation on ``target`` (else where placement says),
        or fail its request when no worker is left."""
        req = self.requests.get(seq.request_id)
        if req is None or seq.is_finished:
            return
        self.num_recovered += 1
        target = target or place_prompt(self.workers, seq.token_ids, self.config)
        if target is None:
            req.worker = None
            req.done = True
            req.error = NoWorkersError("no live worker is left in this cluster to run the "
                                       "request; restart the cluster")
            self.book.notify()
            return
        target.batch.adopt(seq, computed=False)
        req.worker = target
        target.wake.set()

    def _lose(self, w: CellWorker, error: BaseException) -> None:
        """A worker died (or failed a step): recompute its sequences elsewhere."""
        if not w.alive:
            return
        w.state = WorkerState.LOST
        w.gone.set()
        seqs = list(w.batch.seqs.values())
        log.warning("worker %s (%s) lost: %s; recomputing its %d sequences elsewhere",
                    w.worker_id, w.role, error, len(seqs))
        for seq in seqs:
            self._recompute(seq)
        if not any(x.alive for x in self.workers):
            for req in self.requests.values():
                if not req.done:
                    req.done = True
                    req.error = NoWorkersError("every worker of this cluster is lost; "
                                               "restart the cluster")
            self.book.notify()

    # ---- KV handoff ------------------------------------------------------------------
    def _start_handoff(self, src: CellWorker, seq: Sequence, migration: bool = False) -> None:
        """Move a sequence to the decode worker with the most free blocks: a prefilled
        one, or (``migration``) one running on a draining worker.

        The worker holding its pushed blocks comes first (``prefix_push``). Without a
        serving decode worker with room, or while its next step must run where it is
        (``TierPlanner.may_move``), the sequence decodes where it is. The export is
        submitted here, before the source's next step, so it never waits behind another
        prefill.
        """
        tiers = src.batch.tiers
        if tiers is not None and not tiers.may_move(seq.num_tokens, seq.num_prompt_tokens):
            return
        pushed = self.pushes.holder(seq) if self.pushes is not None else None
        holder = pushed.dst if pushed else None
        handoff = None
        for dst in dict.fromkeys(w for w in (holder, decode_target(self.workers, src)) if w):
            ahead = (pushed.moved, pushed.in_flight) if pushed and dst is holder else (0, None)
            handoff = Handoff.begin(src, dst, seq, self.config.block_size, *ahead)
            if handoff is not None:
                break
        if handoff is None:
            return
        self.requests[seq.request_id].worker = None
        self._spawn(self._hand_off(handoff, migration))

    async def _hand_off(self, h: Handoff, migration: bool) -> None:
        outcome = await h.run(self.config.transfer_timeout_s)
        if outcome is Outcome.FAILED:
            await self._check_alive(h.dst)
        ok = outcome is Outcome.MOVED
        h.release_source()
        seq, dst = h.seq, h.dst
        if seq.is_finished:   # aborted meanwhile
            h.drop_reservation()
        elif ok and dst.alive:
            h.commit()
            self.requests[seq.request_id].worker = dst
            self.num_migrated += migration
        else:
            # Recompute on the decode side when it lives, so a transfer that keeps
            # failing cannot bounce the sequence between prefill and handoff forever.
            h.drop_reservation()
            self._recompute(seq, dst if dst.alive else None)
        dst.wake.set()

    async def _check_alive(self, w: CellWorker) -> None:
        """Ping a worker; only Ray's word that the actor died makes it lost (a slow
        answer may just be queued behind a long KV import)."""
        try:
            await asyncio.wait_for(w.handle.ping(), _PING_TIMEOUT_S)
        except WorkerLostError as e:
            self._lose(w, e)
        except asyncio.TimeoutError:
            log.warning("worker %s did not answer a ping within %.0f s", w.worker_id,
                        _PING_TIMEOUT_S)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

