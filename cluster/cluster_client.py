"""A caller of a running global scheduler: submit, stream, abort, stats.

The router replicas and the offline ``LLM`` reach the cell the same way: through a
``ClusterClient`` holding the scheduler's actor (``ClusterEngine``, which launches the
cell, is its first client; a router replica attaches another by name). It offers
``LocalEngine``'s interface (``add_request`` / ``step`` / ``abort_request``) for the
offline API and streams (``open_stream``, ``generate_stream``) for the HTTP router.
Tokenization and detokenization (stop strings included) stay on this side: the
scheduler streams token ids. Launching the cell is ``cluster_engine``'s job, done
only by the cell's owner.
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
from ray.exceptions import RayActorError, RayTaskError

from cluster.engine import tokenize_prompt
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestOutput
from cluster.resumable import RESUME_TIMEOUT_S, Resumable, ResumeBook, reattach
from cluster.scheduler_actor import NAMESPACE, scheduler_name
from scheduler.client_leases import ClientExpiredError
from scheduler.protocol import SamplingParams
from scheduler.request_book import Updates
from scheduler.sequence import SeqUpdate, child_seq_id
from scheduler.stats import CellStats
from workers.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_POLL_S = 1.0  # a long-poll for outputs returns at least this often


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
        # The long-poll in flight. The scheduler hands news to one poll only, so a pump
        # cancelled while it waits (its event loop closed) leaves the poll here for the
        # next pump to take, rather than dropping the tokens it carries.
        self._poll: ray.ObjectRef | None = None
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
        scheduler = self.scheduler
        try:
            return await _aget(scheduler.stats.remote())
        except RayActorError:
            if not self._reattach(scheduler):
                raise
            return await _aget(self.scheduler.stats.remote())

    def _reattach(self, lost: Any) -> bool:
        """Hold the scheduler now under this client's name if it is another actor than
        ``lost``, the one a call just found gone (the cell was relaunched); whether
        there is one to retry on. Compared with ``lost``, not with the handle held:
        of concurrent calls that found it gone, the first swaps the handle and the
        others must retry too."""
        if self.name is None:
            return False
        try:
            actor = ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:
            return False
        if actor._actor_id == lost._actor_id:
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
            scheduler = self.scheduler
            try:
                for cid, choice, k in choices:
                    await _aget(scheduler.submit.remote(cid, prompt_token_ids, choice,
                                                        priority, self.client_id, k))
                break
            except RayActorError:   # gone: under its name may be a relaunched cell's
                if attempt or not self._reattach(scheduler):
                    self._forget(rid)
                    raise
            except BaseException:
                await _abort_all(scheduler, self._children(rid))
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
            if self._poll is None:
                self._poll = self.scheduler.get_client_updates.remote(self.client_id, _POLL_S)
            try:
                news = await _aget(self._poll)
            except (RayActorError, ClientExpiredError) as e:   # lost, or took it for gone
                self._poll = None
                if await self._resume(e):
                    continue
                for queue in self._streams.values():
                    queue.put_nowait(e)
                return
            except Exception as e:
                self._poll = None
                for queue in self._streams.values():
                    queue.put_nowait(e)
                return
            self._poll = None
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
