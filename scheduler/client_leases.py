"""Which callers of the scheduler are still there.

A router replica streams its requests through one long-poll after another
(``GlobalScheduler.get_client_updates``); a replica that died polls no more, and
nothing else would tell the scheduler. So a client whose requests are known holds a
lease, renewed by every poll: once it has neither a poll waiting nor one ended within
``lease_s``, it is gone, and its requests are aborted so no orphan sequence keeps KV
blocks or compute. A client that was only slow learns it at its next poll
(``ClientExpiredError``) and resubmits its requests.
"""

from __future__ import annotations

import time
from collections import Counter


class ClientExpiredError(RuntimeError):
    """The client's lease ran out and its requests were aborted; resubmit them."""


class ClientLeases:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._polling = Counter[str]()   # long-polls waiting now
        self._seen: dict[str, float] = {}   # when it last submitted or ended a poll
        self._expired: set[str] = set()

    def touch(self, client: str) -> None:
        """The client submitted: it is there (again)."""
        self._expired.discard(client)
        self._seen[client] = time.monotonic()

    def begin_poll(self, client: str) -> None:
        if client in self._expired:
            raise ClientExpiredError(f"client {client}: no poll for over {self.lease_s} s, "
                                     "so its requests were aborted; resubmit them")
        self._polling[client] += 1

    def end_poll(self, client: str) -> None:
        self._polling[client] -= 1
        if not self._polling[client]:
            del self._polling[client]
        self._seen[client] = time.monotonic()

    def expire(self, clients: list[str]) -> list[str]:
        """Of ``clients`` (those with requests), the ones gone now; each is marked so."""
        deadline = time.monotonic() - self.lease_s
        gone = [c for c in clients
                if not self._polling[c] and self._seen.get(c, deadline) <= deadline]
        for c in gone:
            self._seen.pop(c, None)
            self._expired.add(c)
        return gone
