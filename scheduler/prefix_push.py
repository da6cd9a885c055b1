"""Prefix pushes: a long prompt's finished blocks go to its decode worker while the rest
of the prompt prefills.

A prefill worker computes a long prompt in chunks (``max_num_batched_tokens`` a step),
and a chunk's full blocks are final once it is computed. After each chunk, the full
blocks not yet sent move to the decode worker the sequence will go to, into that
worker's prefix cache: reserved there, filled by the export and import a handoff uses,
then committed and released, so they are cached blocks that no sequence holds. When the
last chunk samples the first token, the handoff goes to that worker (``holder``), finds
those blocks in its prefix cache (and shares the blocks of a push still moving) and
moves only the rest. The wait between the first and the second token then holds one
chunk's copy instead of the whole prompt's: the copy overlaps the prefill, as layer-wise
KV streaming does in other P/D systems, here at the granularity of a chunk.

Nothing here can change a token. A push that fails or times out commits nothing; its
blocks, and those the decode worker evicts before the handoff, are sent by the handoff.
Pushes skip pools without prefix caching and sequences that will arrive in offload mode
(their middle goes to the host tier, not to the pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from scheduler.cell_worker import CellWorker
from scheduler.handoff import HostRows, InFlightPush, move, submit_export
from scheduler.placement import decode_target
from scheduler.sequence import Sequence
from scheduler.worker_handle import KVExport

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pushed:
    """One prefilling sequence's pushes: its first ``blocks`` blocks are in ``dst``'s
    prefix cache, ``moved`` of them sent by pushes (the rest were cached there already);
    ``in_flight`` while a push moves the next ones."""

    src: CellWorker
    dst: CellWorker
    blocks: int = 0
    moved: int = 0
    in_flight: InFlightPush | None = None


class PrefixPushes:
    def __init__(self, block_size: int, timeout_s: float,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        """``spawn`` runs a push's transfer as a task the scheduler owns."""
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._spawn = spawn
        self._seqs: dict[str, Pushed] = {}

    def after_step(self, src: CellWorker, workers: list[CellWorker]) -> None:
        """Push the full blocks that ``src``'s last step finished, for its sequences
        still prefilling."""
        self._seqs = {sid: p for sid, p in self._seqs.items()
                      if p.src.alive and sid in p.src.batch.seqs}
        for seq in src.batch.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._push(src, seq, workers)

    def holder(self, seq: Sequence) -> Pushed | None:
        """``seq``'s pushes to the serving worker holding (or receiving) its pushed
        blocks, where its handoff should go; None when nothing was pushed (a target with
        no room, or one that would not keep them, is no reason to prefer it). Forgets the
        sequence: its pushes are over."""
        pushed = self._seqs.pop(seq.seq_id, None)
        if pushed is None or not (pushed.blocks or pushed.in_flight) or not pushed.dst.serving:
            return None
        return pushed

    def _push(self, src: CellWorker, seq: Sequence, workers: list[CellWorker]) -> None:
        full = seq.num_computed_tokens // self.block_size
        pushed = self._seqs.get(seq.seq_id)
        if pushed is None or not (pushed.in_flight or pushed.dst.serving):
            dst = decode_target(workers, src)
            if dst is None:
                return
            pushed = self._seqs[seq.seq_id] = Pushed(src, dst)
        dst = pushed.dst
        if pushed.in_flight or full <= pushed.blocks or not _takes(dst, seq):
            return
        push_id = f"push:{seq.seq_id}"
        reserved = dst.kv.reserve(push_id, seq.token_ids, full * self.block_size)
        if reserved is None:   # no room there now; the handoff sends them
            return
        cached, fresh = reserved
        if not fresh:
            dst.kv.free(push_id)
            pushed.blocks = full
            return
        export = submit_export(src, dst, seq, len(cached), len(fresh), self.block_size)
        push = InFlightPush(len(cached), fresh, asyncio.get_running_loop().create_future())
        pushed.in_flight = push
        self._spawn(self._run(pushed, seq, push_id, push, export, full))

    async def _run(self, pushed: Pushed, seq: Sequence, push_id: str, push: InFlightPush,
                   export: KVExport, full: int) -> None:
        """Move one push, then commit its blocks to the receiver's prefix cache (only
        if it moved), release them there and say how it went to a handoff sharing
        them."""
        src, dst = pushed.src, pushed.dst
        start = time.perf_counter()
        moved = False
        try:
            info, _ = await asyncio.wait_for(
                move(export, dst, push.block_ids, HostRows(0, [])), self.timeout_s)
        except Exception as e:   # refused, timed out, a lost worker: the handoff sends them
            log.info("prefix push of %s from %s to %s failed (%s)", seq.seq_id,
                     src.worker_id, dst.worker_id, e)
            for stats in (src.sent, dst.received):
                stats.push_failures += 1
        else:
            moved = True
            dst.kv.commit(push_id, seq.token_ids, full * self.block_size)
            pushed.blocks = full
            pushed.moved += len(push.block_ids)
            for stats in (src.sent, dst.received):
                stats.pushes += 1
                stats.pushed_bytes += info.nbytes
                stats.push_seconds += time.perf_counter() - start
        dst.kv.free(push_id)
        pushed.in_flight = None
        push.landed.set_result(moved)


def _takes(dst: CellWorker, seq: Sequence) -> bool:
    """Whether ``dst`` would find ``seq``'s pushed blocks at its handoff: in its prefix
    cache, and in its pool rather than its host tier."""
    tiers = dst.batch.tiers
    return dst.kv.enable_caching and not (
        tiers is not None and tiers.middle_to_receive(seq.num_prompt_tokens + 1))
