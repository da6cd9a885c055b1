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
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.config import EngineConfig, WorkerPoolConfig, sampling_defaults
from cluster.engine import resolve_max_model_len, tokenize_prompt
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestOutput
from scheduler.global_scheduler import GlobalScheduler, WorkerRef
from scheduler.protocol import SamplingParams
from scheduler.sequence import SeqUpdate
from workers.loading import Checkpoint, load_checkpoint
from workers.tokenizer import Tokenizer
from workers.worker import Worker, WorkerInfo, WorkerSpec

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
    call per round, not one per stream.
    """

    def __init__(self, scheduler: Any, tokenizer: Tokenizer | None, vocab_size: int,
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.outputs = OutputProcessor(tokenizer)
        self.client_id = uuid.uuid4().hex
        self._pending: set[str] = set()
        self._streams: dict[str, asyncio.Queue] = {}
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
        return cls(actor, tokenizer, vocab_size, max_model_len)

    # ---- LocalEngine's interface -----------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.vocab_size, self.max_model_len,
                               prompt, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0, stream: bool = False) -> None:
        """Submit a request; raises ``OverloadedError`` at once when the queue is full."""
        self.outputs.add(request_id, prompt, prompt_token_ids, params, stream)
        try:
            _get(self.scheduler.submit.remote(request_id, prompt_token_ids, params, priority))
        except BaseException:
            self.outputs.requests.pop(request_id, None)
            raise
        self._pending.add(request_id)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        self._pending.discard(request_id)
        outputs, _ = self.outputs.process(_get(self.scheduler.abort.remote(request_id)))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Wait (up to a second) for news of the pending requests and return their outputs."""
        if not self._pending:
            return []
        news = _get(self.scheduler.get_updates.remote(sorted(self._pending), _POLL_S))
        results, to_stop = self._absorb(news)
        for rid, (_, done, _) in news.items():
            if done or rid not in self.outputs.requests:
                self._pending.discard(rid)
        for seq_id in to_stop:   # a stop string matched: the scheduler stops it too
            _get(self.scheduler.abort.remote(seq_id, "stop"))   # n=1: seq id == request id
        return results

    def stats(self) -> dict[str, Any]:
        """The scheduler's per-worker figures (see ``GlobalScheduler.stats``)."""
        return _get(self.scheduler.stats.remote())

    async def astats(self) -> dict[str, Any]:
        return await _aget(self.scheduler.stats.remote())

    # ---- streaming -------------------------------------------------------------------
    async def open_stream(self, prompt_token_ids: list[int], params: SamplingParams,
                          prompt: str | None = None, request_id: str | None = None,
                          priority: int = 0) -> RequestStream:
        """Submit one request (raising ``OverloadedError`` and the like at once) and
        return the stream of its outputs."""
        rid = request_id or f"stream-{self.client_id[:8]}-{next(self._ids)}"
        self.outputs.add(rid, prompt, prompt_token_ids, params, stream=True)
        self._streams[rid] = queue = asyncio.Queue()
        try:
            await _aget(self.scheduler.submit.remote(rid, prompt_token_ids, params, priority,
                                                     self.client_id))
        except BaseException:
            self._forget(rid)
            raise
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
        outputs (or the error that ended it)."""
        while self._streams:
            try:
                news = await _aget(self.scheduler.get_client_updates.remote(self.client_id,
                                                                            _POLL_S))
            except Exception as e:   # the scheduler is gone: every open stream ends
                for queue in self._streams.values():
                    queue.put_nowait(e)
                return
            results, to_stop = self._absorb(news)
            for rid, (_, _, error) in news.items():
                if error is not None and rid in self._streams:
                    self._streams.pop(rid).put_nowait(error)
            for out in results:   # a finished stream leaves: its queue holds the rest
                if out.request_id in self._streams:
                    queue = self._streams.pop(out.request_id) if out.finished \
                        else self._streams[out.request_id]
                    queue.put_nowait(out)
            for seq_id in to_stop:
                await _aget(self.scheduler.abort.remote(seq_id, "stop"))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.outputs.requests.pop(request_id, None)

    # ---- internals -------------------------------------------------------------------
    def _absorb(self, news: dict[str, tuple[list[SeqUpdate], bool, Exception | None]]
                ) -> tuple[list[RequestOutput], list[str]]:
        """Turn the scheduler's news into outputs; a request that ended in an error is
        dropped here and raised (step) or handed to its stream (pump) by the caller."""
        updates: list[SeqUpdate] = []
        for rid, (ups, _, error) in news.items():
            if error is not None:
                self._pending.discard(rid)
                self.outputs.requests.pop(rid, None)
                if rid not in self._streams:
                    raise error
            updates.extend(ups)
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
        self.client._forget(self.request_id)
        await asyncio.shield(_detached(_aget(self.client.scheduler.abort.remote(
            self.request_id))))


class ClusterEngine(ClusterClient):
    """Launches a cluster (worker actors and the global scheduler) and is its first client."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
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
        self.workers: dict[str, Any] = {}
        try:
            refs = self._start_workers(spec)
            scheduler = self._start_scheduler(refs)
        except BaseException:
            self._kill_workers()
            raise
        ray.get(scheduler.start.remote())
        super().__init__(scheduler, ckpt.tokenizer, ckpt.config.vocab_size, self.max_model_len)

    def _start_workers(self, spec: WorkerSpec) -> list[WorkerRef]:
        """Launch every pool's actors; wait until each has loaded the model and sized its
        pool; settle the context length on the smallest pool."""
        roles: dict[str, str] = {}
        per_role: Counter[str] = Counter()
        for pool in self.config.cluster.pools:
            for _ in range(pool.count):
                worker_id = f"{pool.role}-{per_role[pool.role]}"
                per_role[pool.role] += 1
                self.workers[worker_id] = _launch(spec, pool)
                roles[worker_id] = pool.role
        infos: list[WorkerInfo] = ray.get([w.info.remote() for w in self.workers.values()])
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
        return [WorkerRef(wid, roles[wid], actor, info.num_blocks, info.host_blocks, info.place)
                for (wid, actor), info in zip(self.workers.items(), infos)]

    def _start_scheduler(self, refs: list[WorkerRef]) -> Any:
        """The global scheduler as a named, detached async actor. One of the same name
        left behind by a killed driver (all its workers dead) is replaced."""
        cc, cfg = self.config.cluster, self.config
        name = scheduler_name(cc.name)

        def create() -> Any:
            return ray.remote(GlobalScheduler).options(
                name=name, namespace=NAMESPACE, lifetime="detached",
                num_cpus=0, max_concurrency=10_000).remote(
                refs, cfg.scheduler, self.block_size, cfg.cache.enable_prefix_caching,
                self.max_model_len, self._eos_token_ids, cc.prefill_threshold,
                cc.max_waiting, cc.transfer_timeout_s, cc.max_prefill_queue_tokens,
                cfg.long_context)

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
        try:
            ray.get(self.scheduler.shutdown.remote(), timeout=10)
        finally:
            ray.kill(self.scheduler)
            self._kill_workers()

    def _kill_workers(self) -> None:
        for actor in self.workers.values():
            ray.kill(actor)


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
        if not any(w["alive"] for w in stats["workers"]):
            log.warning("replacing scheduler %s: all its workers are dead (its driver "
                        "exited without shutting it down)", name)
            ray.kill(old)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_STALE_POLL_S)


def _launch(spec: WorkerSpec, pool: WorkerPoolConfig) -> Any:
    """One worker actor with the pool's resources and torch threads."""
    return ray.remote(Worker).options(**worker_options(pool, spec.device)).remote(
        dataclasses.replace(spec, num_threads=pool.threads), pool.role)


def worker_options(pool: WorkerPoolConfig, device: str) -> dict[str, Any]:
    """Ray actor options for one worker of ``pool``. A worker on ``device: npu`` holds one
    NPU (``{"NPU": 1}`` unless the pool names another amount): Ray then places it on a
    node with a free NPU and sets ``ASCEND_RT_VISIBLE_DEVICES`` to it."""
    resources = dict(pool.resources)
    if device == "npu":
        resources.setdefault("NPU", 1.0)
    options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 0),
                               "num_gpus": resources.pop("GPU", 0), "max_restarts": 0}
    if resources:
        options["resources"] = resources
    return options


_background: set[asyncio.Task] = set()


def _detached(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run ``coro`` outside the caller's context: Ray (and Serve, for a request whose
    client went away) cancels the actor calls made in a cancelled task's context, and
    the shared long-poll or the abort of that very request must not be among them."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


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
