"""What a client of the scheduler (a router replica) holds to resume its requests when
the control plane behind it fails, and how it finds the scheduler again.

Every scheduler request (one choice) a client streams is kept as a ``Resumable``: its
prompt tokens, sampling settings and sample index (which, with the seed, fix every
seeded draw by its position) and priority. With the tokens the client has received,
that is all a scheduler needs to go on where the request was: resubmitted with them,
it is recomputed from prompt plus received tokens, as a lost worker's sequences are.
The client sees neither an error nor repeated text, and seeded sampling continues as
if nothing happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

from cluster.output_processor import OutputProcessor
from scheduler.protocol import SamplingParams

log = logging.getLogger(__name__)

RESUME_TIMEOUT_S = 120.0   # how long a client waits for its scheduler to serve again
_PROBE_TIMEOUT_S = 5.0
_PROBE_EVERY_S = 0.5


@dataclass(frozen=True)
class Resumable:
    """One streamed scheduler request, as it was submitted."""

    request_id: str   # the caller's request, whose outputs hold what was received
    prompt_token_ids: list[int]
    params: SamplingParams   # n = 1: one choice
    priority: int
    sample_index: int

    def resubmission(self, outputs: OutputProcessor) -> tuple[list[int], SamplingParams]:
        """The tokens received so far and the settings to resubmit with: prompt
        logprobs already received are not asked for again."""
        generated, scored = outputs.progress(self.request_id, self.sample_index)
        params = self.params
        if scored and params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)
        return generated, params


class ResumeBook:
    """A client's open ``Resumable``s, by scheduler request id."""

    def __init__(self) -> None:
        self._requests: dict[str, Resumable] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, seq_request_id: str, r: Resumable) -> None:
        self._requests[seq_request_id] = r

    def drop(self, seq_request_id: str) -> None:
        self._requests.pop(seq_request_id, None)

    async def resubmit(self, scheduler: Any, client_id: str, outputs: OutputProcessor,
                       open_requests: set[str]) -> None:
        """Submit every request still streaming to ``scheduler`` again, with the tokens
        received so far; an abort first, in case it was not lost after all. A resumed
        request was admitted once: the waiting queue's limit does not refuse it."""
        for cid, r in list(self._requests.items()):
            if r.request_id not in open_requests:
                del self._requests[cid]
                continue
            generated, params = r.resubmission(outputs)
            await scheduler.abort.remote(cid)
            await scheduler.submit.remote(cid, r.prompt_token_ids, params, r.priority,
                                          client_id, r.sample_index, generated)
        log.info("resumed %d requests", len(self._requests))


async def reattach(name: str | None, namespace: str, current: Any,
                   timeout_s: float = RESUME_TIMEOUT_S) -> Any | None:
    """The scheduler once it serves again (answers, is not recovering, has a live
    worker): found by ``name`` (a restarted actor keeps its name, a relaunched cell's
    is a new actor under it), else ``current``. None if it does not within
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            actor = ray.get_actor(name, namespace=namespace) if name else current
            stats = await asyncio.wait_for(actor.stats.remote(), _PROBE_TIMEOUT_S)
            if not stats.recovering and stats.live():
                return actor
        except (ValueError, RayError, asyncio.TimeoutError) as e:
            log.info("the scheduler does not serve yet: %s", type(e).__name__)
        await asyncio.sleep(_PROBE_EVERY_S)
    return None
