"""The scheduler's requests as their callers see them: pending news, long-polls, clients.

A caller learns what became of its requests only by long-polling
(``GlobalScheduler.get_updates`` / ``get_client_updates``): each request collects its
updates here until the next poll takes them, and a finished one is forgotten once
returned. A router replica polls for all its requests at once, as a client whose lease
(``client_leases``) says whether it is still there. The request-level figures (TTFT,
TPOT, ``serving_stats``' totals) are kept here too, where every update passes. Where a
request runs (placement, step loops, handoff, recovery) is ``global_scheduler``'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.cell_worker import CellWorker
from scheduler.client_leases import ClientLeases
from scheduler.sequence import Sequence, SeqUpdate
from scheduler.serving_stats import RequestTimes, ServingStats
from scheduler.stats import LatencyWindow

Updates = dict[str, tuple[list[SeqUpdate], bool, Exception | None]]


@dataclass(eq=False)
class Request:
    """One submitted choice: where it runs and what its caller has not taken yet."""

    seq: Sequence
    worker: CellWorker | None   # None while its KV is being handed over
    updates: list[SeqUpdate] = field(default_factory=list)
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    done: bool = False
    error: Exception | None = None   # raised to the caller instead of an output


class RequestBook:
    def __init__(self, lease_s: float) -> None:
        self.requests: dict[str, Request] = {}   # not yet returned finished
        self.clients: dict[str, set[str]] = {}   # client -> its requests still known
        self.leases = ClientLeases(lease_s)
        self.ttft = LatencyWindow()
        self.tpot = LatencyWindow()
        self.serving = ServingStats()
        self._pulse = asyncio.Event()

    def add(self, request_id: str, seq: Sequence, worker: CellWorker,
            client: str | None) -> None:
        """A submitted request, running on ``worker``; ``client`` polls for it."""
        self.requests[request_id] = Request(seq, worker)
        if client is not None:
            self.clients.setdefault(client, set()).add(request_id)
            self.leases.touch(client)

    def abort(self, request_id: str, reason: str) -> Request | None:
        """Forget a request and count its end as ``reason``; the request if it was
        still running (its blocks are then the caller's to free), else None."""
        req = self.requests.pop(request_id, None)
        if req is None or req.done:
            return None
        self.serving.finish(req.times, reason, time.monotonic())
        return req

    def publish(self, updates: list[SeqUpdate]) -> None:
        """A step's updates: queued for their callers, timed, and their waiters woken."""
        now = time.monotonic()
        for u in updates:
            req = self.requests.get(u.request_id)
            if req is None:
                continue
            req.updates.append(u)
            if u.new_token_ids:
                t = req.times
                if t.last_token is None:
                    self.ttft.add(now, now - t.arrival)
                else:
                    self.tpot.add(now, (now - t.last_token) / len(u.new_token_ids))
                self.serving.tokens(t, req.seq.num_prompt_tokens, len(u.new_token_ids), now)
            if u.finish_reason is not None:
                req.done = True
                self.serving.finish(req.times, u.finish_reason, now)
        if updates:
            self.notify()

    def notify(self) -> None:
        """Wake every waiting long-poll to look at its requests again."""
        self._pulse.set()
        self._pulse = asyncio.Event()

    async def wait(self, request_ids: Callable[[], list[str]], timeout_s: float) -> Updates:
        """Wait until one of the requests has news (or the timeout); see
        ``GlobalScheduler.get_updates``."""
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

    async def wait_client(self, client: str, timeout_s: float) -> Updates:
        """``wait`` over every live request of ``client``, renewing its lease; raises
        ``ClientExpiredError`` to a client whose lease ran out."""
        self.leases.begin_poll(client)
        try:
            return await self.wait(lambda: self._client_requests(client), timeout_s)
        finally:
            self.leases.end_poll(client)

    def expire_clients(self) -> dict[str, list[str]]:
        """The clients gone now (see ``client_leases``), each with its live requests,
        which are no longer theirs: the caller aborts them."""
        gone = {}
        for client in self.leases.expire(sorted(self.clients)):
            gone[client] = self._client_requests(client)
            self.clients.pop(client, None)
        return gone

    def _client_requests(self, client: str) -> list[str]:
        live = {rid for rid in self.clients.pop(client, ()) if rid in self.requests}
        if live:
            self.clients[client] = live
        return sorted(live)
