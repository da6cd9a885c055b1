"""The engine behind ``LLM`` when the configuration names worker pools: a Ray cluster.

It starts (or joins) a Ray instance, launches the worker actors of every pool with
their resources, and the global scheduler as a named, detached actor; then it offers
``LocalEngine``'s interface (``add_request`` / ``step`` / ``abort_request``) for the
offline API and ``generate_stream``, an async generator of outputs for the HTTP router.
Tokenization and detokenization (stop strings included) stay on the caller's side:
the scheduler streams token ids.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster import running_cell, scheduler_actor
from cluster.autoscaler import Autoscaler
from cluster.config import EngineConfig, sampling_defaults
from cluster.engine import resolve_max_model_len, tokenize_prompt
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestOutput
from cluster.pools import WorkerPools
from cluster.ray_worker import RayWorkerHandle
from cluster.resumable import RESUME_TIMEOUT_S, Resumable, ResumeBook, reattach
from scheduler.client_leases import ClientExpiredError
from scheduler.config import CellConfig
from scheduler.request_book import Updates
from scheduler.protocol import SamplingParams
from scheduler.sequence import SeqUpdate, child_seq_id
from scheduler.stats import CellStats
from scheduler.worker_handle import WorkerRef
from workers.loading import Checkpoint, load_checkpoint
from workers.tokenizer import Tokenizer
from workers.worker import WorkerInfo, WorkerSpec

log = logging.getLogger(__name__)

_POLL_S = 1.0  # a long-poll for outputs returns at least this often
_STALE_GRACE_S = 5.0  # how long a scheduler's workers may take to be noticed dead
_STALE_POLL_S = 0.25
NAMESPACE = "llm-cluster"  # where the named schedulers live, whatever the driver's namespace


def scheduler_name(cluster_name: str) -> str:
    return f"llm-scheduler-{cluster_name}"


class ClusterClient:
    """A caller of a running global scheduler: submit, stream, abort, stats.

    ``ClusterEngine`` (which launches the cluster) is one; a router replica attaches
    another to the scheduler by name (``attach``). Streams of one client share a single
    long-poll (``get_client_updates``), so a replica with many open streams makes one
    call per round, not one per stream. When the scheduler is lost, the streams resume
    on it once it serves again (see ``resumable``), found again by ``name``.
    """

    def __init__(self, scheduler: Any, tokenizer: Tokenizer | None, vocab_size: int,
                 max_model_len: int, name: str | None = None) -> None:
        self.scheduler = scheduler
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.outputs = OutputProcessor(tokenizer)
        self.client_id = uuid.uuid4().hex
        self._pending: set[str] = set()   # the scheduler's requests: one per choice
        self._parent: dict[str, str] = {}  # a choice's scheduler request -> its request
        self._streams: dict[str, asyncio.Queue] = {}
        self._resumable = ResumeBook()   # the streamed choices' scheduler requests
        self._pump: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def attach(cls, cluster_name: str, tokenizer: Tokenizer | None, vocab_size: int,
               max_model_len: int) -> ClusterClient:
        """A client of the scheduler that ``cluster_name``'s ``ClusterEngine`` started."""
        try:
            actor = ray.get_actor(scheduler_name(cluster_name), namespace=NAMESPACE)
        except ValueError as e:
            raise ValueError(f"no scheduler named {scheduler_name(cluster_name)!r} runs on "
                             "this Ray instance; start the cluster first") from e
        return cls(actor, tokenizer, vocab_size, max_model_len, scheduler_name(cluster_name))

    # ---- LocalEngine's interface -----------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.vocab_size, self.max_model_len,
                               prompt, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0, stream: bool = False) -> None:
        """Submit a request (its ``n`` choices, see ``_choices``); raises
        ``OverloadedError`` at once when the queue is full."""
        self.outputs.add(request_id, prompt, prompt_token_ids, params, stream)
        submitted: list[str] = []
        try:
            for cid, choice, k in self._choices(request_id, params):
                _get(self.scheduler.submit.remote(cid, prompt_token_ids, choice, priority,
                                                  None, k))
                submitted.append(cid)
        except BaseException:
            for cid in submitted:
                _get(self.scheduler.abort.remote(cid))
                self._parent.pop(cid, None)
            self.outputs.requests.pop(request_id, None)
            raise
        self._pending.update(submitted)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        updates = []
        for cid in self._children(request_id):
            self._pending.discard(cid)
            updates += [self._lift(u) for u in _get(self.scheduler.abort.remote(cid))]
        outputs, _ = self.outputs.process(updates)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Wait (up to a second) for news of the pending requests and return their outputs."""
        if not self._pending:
            return []
        news = _get(self.scheduler.get_updates.remote(sorted(self._pending), _POLL_S))
        results, to_stop = self._absorb(news)
        for cid, (_, done, _) in news.items():
            if done or self._parent.get(cid, cid) not in self.outputs.requests:
                self._pending.discard(cid)
                self._parent.pop(cid, None)
        for seq_id in to_stop:   # a stop string matched: the scheduler stops it too
            _get(self.scheduler.abort.remote(seq_id, "stop"))   # a choice's seq id is its request's
        return results

    def stats(self) -> CellStats:
        """The scheduler's per-worker figures (see ``GlobalScheduler.stats``)."""
        return _get(self.scheduler.stats.remote())

    async def astats(self) -> CellStats:
        try:
            return await _aget(self.scheduler.stats.remote())
        except RayActorError:
            if not self._reattach():
                raise
            return await _aget(self.scheduler.stats.remote())

    def _reattach(self) -> bool:
        """Take the scheduler now under this client's name if it is another actor than
        the one held (the cell was relaunched); whether it is."""
        if self.name is None:
            return False
        try:
            actor = ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:
            return False
        if actor._actor_id == self.scheduler._actor_id:
            return False
        self.scheduler = actor
        return True

    # ---- streaming -------------------------------------------------------------------
    async def open_stream(self, prompt_token_ids: list[int], params: SamplingParams,
                          prompt: str | None = None, request_id: str | None = None,
                          priority: int = 0, sample_index: int | None = None
                          ) -> RequestStream:
        """Submit one request (raising ``OverloadedError`` and the like at once) and
        return the stream of its outputs: its ``n`` choices, or, given ``sample_index``
        (with n = 1), that one choice of a request whose choices stream apart."""
        rid = request_id or f"stream-{self.client_id[:8]}-{next(self._ids)}"
        self.outputs.add(rid, prompt, prompt_token_ids, params, stream=True)
        self._streams[rid] = queue = asyncio.Queue()
        choices = self._choices(rid, params) if sample_index is None else \
            [(rid, params, sample_index)]
        for attempt in range(2):
            try:
                for cid, choice, k in choices:
                    await _aget(self.scheduler.submit.remote(cid, prompt_token_ids, choice,
                                                             priority, self.client_id, k))
                break
            except RayActorError:   # gone: under its name may be a relaunched cell's
                if attempt or not self._reattach():
                    self._forget(rid)
                    raise
            except BaseException:
                await _abort_all(self.scheduler, self._children(rid))
                self._forget(rid)
                raise
        for cid, choice, k in choices:
            self._resumable.add(cid, Resumable(rid, prompt_token_ids, choice, priority, k))
        if self._pump is None or self._pump.done():
            self._pump = _detached(self._pump_updates())
        return RequestStream(self, rid, queue)

    async def generate_stream(self, prompt_token_ids: list[int], params: SamplingParams,
                              prompt: str | None = None, request_id: str | None = None,
                              priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its output as tokens arrive; the last one is
        finished. Closing the generator early aborts the request."""
        stream = await self.open_stream(prompt_token_ids, params, prompt, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def _pump_updates(self) -> None:
        """Long-poll this client's news while any stream is open; hand each stream its
        outputs (or the error that ended it). A lost scheduler's streams resume once
        it serves again; they end only if it does not come back."""
        while self._streams:
            try:
                news = await _aget(self.scheduler.get_client_updates.remote(self.client_id,
                                                                            _POLL_S))
            except (RayActorError, ClientExpiredError) as e:   # lost, or took it for gone
                if await self._resume(e):
                    continue
                for queue in self._streams.values():
                    queue.put_nowait(e)
                return
            except Exception as e:
                for queue in self._streams.values():
                    queue.put_nowait(e)
                return
            results, to_stop = self._absorb(news)
            for cid, (_, done, error) in news.items():
                rid = self._parent.get(cid, cid)
                if error is not None and rid in self._streams:
                    self._streams.pop(rid).put_nowait(error)
                if done:
                    self._parent.pop(cid, None)
                    self._resumable.drop(cid)
            for out in results:   # a finished stream leaves: its queue holds the rest
                if out.request_id in self._streams:
                    queue = self._streams.pop(out.request_id) if out.finished \
                        else self._streams[out.request_id]
                    queue.put_nowait(out)
            for seq_id in to_stop:
                await _aget(self.scheduler.abort.remote(seq_id, "stop"))

    async def _resume(self, error: Exception) -> bool:
        """The scheduler was lost: once it serves again, resubmit every open stream's
        requests with the tokens received so far (an abort first, in case it was not
        lost after all). False if it does not come back in time."""
        log.warning("the scheduler was lost (%s); resuming %d requests once it serves",
                    error, len(self._resumable))
        deadline = time.monotonic() + RESUME_TIMEOUT_S
        while True:
            actor = await reattach(self.name, NAMESPACE, self.scheduler,
                                   deadline - time.monotonic())
            if actor is None:
                return False
            self.scheduler = actor
            try:
                await self._resumable.resubmit(actor, self.client_id, self.outputs,
                                               set(self._streams))
                return True
            except RayActorError as e:   # lost again meanwhile
                log.warning("the scheduler was lost again while resuming: %s", e)
            except Exception:   # it refused a resubmission: the streams end
                log.exception("resuming the requests failed")
                return False

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.outputs.requests.pop(request_id, None)
        for cid in self._children(request_id):
            self._parent.pop(cid, None)
            self._resumable.drop(cid)

    # ---- choices ---------------------------------------------------------------------
    def _choices(self, request_id: str, params: SamplingParams
                 ) -> list[tuple[str, SamplingParams, int]]:
        """A request's ``n`` choices as the scheduler runs them, each a request of its
        own: (its id, n = 1, its sample index). Choice k keeps the request's seed; the
        sampler keys a seeded draw by (seed, sample index, position), as the one-process
        engine's forked choices are, so every path gives the same choices."""
        one = dataclasses.replace(params, n=1)
        choices = [(child_seq_id(request_id, k), one, k) for k in range(params.n)]
        for cid, _, _ in choices[1:]:
            self._parent[cid] = request_id
        return choices

    def _children(self, request_id: str) -> list[str]:
        """The scheduler requests of a request's choices."""
        return [request_id] + [c for c, r in self._parent.items() if r == request_id]

    def _lift(self, u: SeqUpdate) -> SeqUpdate:
        """A choice's update as an update of its request."""
        rid = self._parent.get(u.request_id)
        return u if rid is None else dataclasses.replace(u, request_id=rid)

    # ---- internals -------------------------------------------------------------------
    def _absorb(self, news: Updates) -> tuple[list[RequestOutput], list[str]]:
        """Turn the scheduler's news into outputs; a request that ended in an error is
        dropped here and raised (step) or handed to its stream (pump) by the caller."""
        updates: list[SeqUpdate] = []
        for cid, (ups, _, error) in news.items():
            rid = self._parent.get(cid, cid)
            if error is not None:
                self._pending.discard(cid)
                self.outputs.requests.pop(rid, None)
                if rid not in self._streams:
                    raise error
            updates.extend(self._lift(u) for u in ups)
        return self.outputs.process(updates)


class RequestStream:
    """The outputs of one submitted request as they arrive; the last is finished.
    ``aclose`` before the end aborts the request and frees its blocks."""

    def __init__(self, client: ClusterClient, request_id: str, queue: asyncio.Queue) -> None:
        self.client = client
        self.request_id = request_id
        self._queue = queue
        self._done = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                self._done = item.finished
                yield item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Abort the request unless it has ended (its last output or error delivered)."""
        self._done = True
        if self.request_id not in self.client._streams:
            return
        choices = self.client._children(self.request_id)
        self.client._forget(self.request_id)
        await asyncio.shield(_detached(_abort_all(self.client.scheduler, choices)))


class ClusterEngine(ClusterClient):
    """Launches a cluster (worker actors and the global scheduler) and is its first client.

    ``survive_owner``: the cell outlives this engine's process (its workers are detached,
    as the scheduler always is), and an engine started so adopts a running cell of its
    name (see ``running_cell``) instead of launching another: what Serve's restart of a
    dead ``LLMCell`` replica needs.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 survive_owner: bool = False) -> None:
        cc = config.cluster
        if not cc.pools:
            raise ValueError("cluster.pools: got none; name at least one worker pool to run "
                             "on Ray, or use the one-process engine")
        self.config = config
        if not ray.is_initialized():
            ray.init(address=cc.address, include_dashboard=False, log_to_driver=True)
        mc = config.model
        # The driver needs the tokenizer and the model's shape; cached weights are mmapped.
        ckpt = checkpoint or load_checkpoint(mc.path, dtype=getattr(torch, mc.dtype),
                                             tokenizer=mc.tokenizer,
                                             chat_template=mc.chat_template)
        self.model_config = ckpt.config
        self.sampling_defaults = sampling_defaults(config)
        spec = WorkerSpec(mc.path, mc.tokenizer, mc.dtype, mc.device, mc.seed, mc.ops,
                          config.cache, config.scheduler.max_model_len, 1, config.long_context,
                          mc.quantization)
        self.pools = WorkerPools(spec, cc.pools, cc.replace_backoff_s, cc.name, NAMESPACE,
                                 detached=survive_owner)
        self.workers = self.pools.workers   # worker id -> actor, every live one
        running = running_cell.adopt(scheduler_name(cc.name), NAMESPACE, self.pools) \
            if survive_owner else None
        if running is not None:
            scheduler, refs, started = running.scheduler, running.workers, \
                running.started(self.pools)
            self.block_size = running.settings.block_size
            self.max_model_len = running.settings.max_model_len
            self._eos_token_ids = running.settings.eos_token_ids
            self._fingerprint = running.info.fingerprint
        else:
            try:
                started = self.pools.launch_initial()
                refs = self._join_initial(started)
                scheduler = self._start_scheduler(refs)
            except BaseException:
                self.pools.kill_all()
                raise
            ray.get(scheduler.start.remote())
        self.pools.serve(scheduler, started, refs, self._fingerprint, self.block_size,
                         -(-self.max_model_len // self.block_size))
        self.autoscaler: Autoscaler | None = None
        if any(lo < hi for lo, hi in (p.bounds for p in cc.pools)):
            self.autoscaler = Autoscaler(scheduler, self.pools, cc.autoscale)
            self.autoscaler.start()
        super().__init__(scheduler, ckpt.tokenizer, ckpt.config.vocab_size, self.max_model_len,
                         scheduler_name(cc.name))

    def _join_initial(self, started: list[tuple[str, int, Any]]) -> list[WorkerRef]:
        """Wait until the first workers have loaded the model and sized their pools;
        settle the context length on the smallest pool."""
        infos: list[WorkerInfo] = ray.get([a.info.remote() for _, _, a in started])
        fingerprints = {i.fingerprint for i in infos}
        if len(fingerprints) != 1:
            raise RuntimeError(f"workers loaded different models ({sorted(fingerprints)}); "
                               "every worker must see the same checkpoint files")
        sizes = {i.block_size for i in infos}
        if len(sizes) != 1:
            raise RuntimeError(f"workers chose different KV block sizes ({sorted(sizes)}): "
                               "their devices' defaults differ; set cache.block_size")
        bs, lc = sizes.pop(), self.config.long_context
        self.block_size = bs
        self.max_model_len = resolve_max_model_len(
            self.config.scheduler.max_model_len, infos[0].model_max_len,
            min(i.num_blocks for i in infos) * bs,
            min(lc.longest_context(i.host_blocks, bs) for i in infos) if lc.enabled else None)
        self._eos_token_ids = infos[0].eos_token_ids
        self._fingerprint = infos[0].fingerprint
        pools = self.config.cluster.pools
        return [WorkerRef(wid, pools[pool].role, RayWorkerHandle(actor), info.num_blocks,
                          info.host_blocks, info.place)
                for (wid, pool, actor), info in zip(started, infos)]

    def _start_scheduler(self, refs: list[WorkerRef]) -> Any:
        """The global scheduler as a named, detached async actor. One of the same name
        left behind by a killed driver (all its workers dead) is replaced."""
        cc, cfg = self.config.cluster, self.config
        name = scheduler_name(cc.name)
        cell = CellConfig(cfg.scheduler, self.block_size, self.max_model_len,
                          self._eos_token_ids, cfg.cache.enable_prefix_caching,
                          cc.prefill_threshold, cc.max_prefill_queue_tokens, cc.max_waiting,
                          cc.transfer_timeout_s, cfg.long_context)

        def create() -> Any:
            return scheduler_actor.launch(name, NAMESPACE, refs, cell)

        try:
            return create()
        except ValueError as e:
            if not _remove_stale_scheduler(name):
                raise ValueError(f"cluster.name: a scheduler named {name!r} already runs "
                                 "on this Ray instance with live workers; shut it down or "
                                 "pick another cluster.name") from e
        deadline = time.monotonic() + _STALE_GRACE_S
        while True:   # a killed actor's name is freed asynchronously
            try:
                return create()
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(_STALE_POLL_S)

    # ---- shutdown --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the scheduler and the workers (the scheduler is detached: it would
        outlive this process otherwise)."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.pools.stop()
        try:
            ray.get(self.scheduler.shutdown.remote(), timeout=10)
        finally:
            ray.kill(self.scheduler)
            self.pools.kill_all()


def _remove_stale_scheduler(name: str) -> bool:
    """Kill the scheduler ``name`` if none of its workers is alive: its driver died
    without shutting it down (the scheduler is detached, its workers are not). Returns
    whether the name is free (or soon will be); False when the scheduler still serves."""
    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True   # gone meanwhile
    deadline = time.monotonic() + _STALE_GRACE_S
    while True:
        try:
            stats = ray.get(old.stats.remote(), timeout=_STALE_GRACE_S)
        except RayActorError:
            return True
        except GetTimeoutError:
            return False   # busy, not dead: leave it alone
        if not stats.live():
            log.warning("replacing scheduler %s: all its workers are dead (its driver "
                        "exited without shutting it down)", name)
            ray.kill(old)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_STALE_POLL_S)


_background: set[asyncio.Task] = set()


def _detached(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run ``coro`` outside the caller's context: Ray (and Serve, for a request whose
    client went away) cancels the actor calls made in a cancelled task's context, and
    the shared long-poll or the abort of that very request must not be among them."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def _abort_all(scheduler: Any, request_ids: list[str]) -> None:
    await asyncio.gather(*(_aget(scheduler.abort.remote(rid)) for rid in request_ids))


def _get(ref: Any) -> Any:
    """``ray.get``, raising the remote error itself (e.g. ``OverloadedError``)."""
    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise _cause(e) from None


async def _aget(ref: Any) -> Any:
    try:
        return await ref
    except RayTaskError as e:
        raise _cause(e) from None


def _cause(e: RayTaskError) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e
