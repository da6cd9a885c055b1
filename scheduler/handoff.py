"""A KV handoff: one sequence's computed KV moves from one worker's pool to another's.

The receiver reserves blocks (reusing its own prefix cache), the sender exports only
the rest through the transport the two workers share (``kvcache.kv_transport``: shared
memory on one node, else the object store, in parts), the receiver imports that
export; the sender frees its blocks (they stay in
its prefix cache) only after the receiver has acknowledged. Blocks a prefix push is
still moving to the receiver are shared, not sent twice: the handoff waits for that
push and sends them itself only if it failed. A sequence in offload mode sends its
middle from the sender's host tier, whose blocks are held until the end as its pool's
are. Bytes never pass here: the sender's handle makes an export and the receiver's
handle takes it. A prefilled sequence leaving a prefill worker and a running one
leaving a draining worker move the same way.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from kvcache.kv_transport import HandoffInfo, plan_handoff
from scheduler.cell_worker import CellWorker
from scheduler.sequence import Sequence
from scheduler.tiering import LentBlocks
from scheduler.worker_handle import KVExport

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    MOVED = "moved"
    TIMED_OUT = "timed out"   # abandoned: the receiver may just be slow
    FAILED = "failed"         # refused, lost, or broken: the receiver may be gone


@dataclass
class HostRows:
    """Rows of a handoff's export, from ``first_row`` on, that go to the receiver's host
    tier (``block_ids``), the middle of a sequence arriving in offload mode."""

    first_row: int
    block_ids: list[int]


@dataclass
class InFlightPush:
    """A prefix push still moving: it fills the receiver's ``block_ids``, the sequence's
    blocks from table index ``first`` on; ``landed`` says whether it moved them."""

    first: int
    block_ids: list[int]
    landed: asyncio.Future[bool]


@dataclass(eq=False)
class Handoff:
    src: CellWorker
    dst: CellWorker
    seq: Sequence
    fresh: list[int]          # receiver blocks the export fills
    host: HostRows
    export: KVExport | None   # None: the receiver held everything already
    block_size: int
    push: InFlightPush | None = None   # a push still filling blocks this handoff shares
    lent: LentBlocks | None = None   # the sender's host blocks, freed with its pool's

    @classmethod
    def begin(cls, src: CellWorker, dst: CellWorker, seq: Sequence, block_size: int,
              pushed: int = 0, in_flight: InFlightPush | None = None) -> Handoff | None:
        """Reserve room on ``dst``, take ``seq`` out of ``src``'s batch (its blocks stay)
        and submit the export; None, with nothing changed, when ``dst`` has no room.

        ``pushed``: leading blocks that prefix pushes moved to ``dst`` for this sequence.
        Found in its prefix cache, they count in its hit rate as moved, not as hits.
        ``in_flight``: a push to ``dst`` still moving the blocks after those. The handoff
        shares its blocks instead of sending them again, waits for it, and sends them
        itself only if it failed.
        """
        tiers = dst.batch.tiers
        # A sequence that will decode in offload mode sends its middle to the host tier.
        middle = tiers.middle_to_receive(seq.num_computed_tokens + 1) if tiers else None
        arriving = (in_flight.first, in_flight.block_ids) if in_flight else None
        reserved = dst.kv.reserve(seq.seq_id, seq.token_ids, seq.num_computed_tokens, middle,
                                  arriving)
        if reserved is None:
            return None
        cached, fresh = reserved
        push = None
        if in_flight is not None and cached[in_flight.first:][:1] == in_flight.block_ids[:1]:
            push = InFlightPush(in_flight.first, cached[in_flight.first:], in_flight.landed)
            pushed += len(push.block_ids)
        dst.kv.stats.record(seq.num_computed_tokens, max(len(cached) - pushed, 0) * block_size)
        host = HostRows(middle[0] - len(cached), tiers.receive(seq.seq_id, middle)) \
            if middle else HostRows(0, [])
        lent = src.batch.tiers.lend_host_blocks(seq.seq_id) if src.batch.tiers else None
        src.batch.detach(seq.seq_id)
        count = len(fresh) + len(host.block_ids)
        export = (submit_export(src, dst, seq, len(cached), count, block_size, lent)
                  if count else None)
        src.outgoing += 1
        return cls(src, dst, seq, fresh, host, export, block_size, push, lent)

    async def run(self, timeout_s: float) -> Outcome:
        """Move the KV. Failures are counted and logged."""
        start = time.perf_counter()
        try:
            if self.export is not None:
                info, exported = await asyncio.wait_for(self._move(), timeout_s)
                elapsed = time.perf_counter() - start
                for stats in (self.src.sent, self.dst.received):
                    stats.count += 1
                    stats.bytes += info.nbytes
                    stats.seconds += elapsed
                    stats.export_seconds += exported - start
                    kind = info.label
                    stats.transports[kind] = stats.transports.get(kind, 0) + 1
            if self.push is not None:
                resent = await self._after_push(timeout_s)
                for stats in (self.src.sent, self.dst.received):
                    stats.bytes += resent
            return Outcome.MOVED
        except asyncio.TimeoutError:
            log.warning("KV transfer of %s from %s to %s took over %.1f s: abandoned",
                        self.seq.seq_id, self.src.worker_id, self.dst.worker_id, timeout_s)
            outcome = Outcome.TIMED_OUT
        except Exception as e:   # refused (KVTransferError), a lost worker, anything else
            log.warning("KV transfer of %s from %s to %s failed (%s)", self.seq.seq_id,
                        self.src.worker_id, self.dst.worker_id, e)
            outcome = Outcome.FAILED
        self.src.sent.failures += 1
        self.dst.received.failures += 1
        return outcome

    def release_source(self) -> None:
        """The sender's part is over (moved or not): free its blocks."""
        self.src.kv.free(self.seq.seq_id)
        if self.lent is not None:
            self.src.batch.tiers.free_lent(self.lent)
        self.src.outgoing -= 1
        self.src.wake.set()

    def commit(self) -> None:
        """The receiver runs the sequence from its imported KV."""
        self.dst.kv.commit(self.seq.seq_id, self.seq.token_ids, self.seq.num_computed_tokens)
        self.dst.batch.adopt(self.seq, computed=True)

    def drop_reservation(self) -> None:
        """Free what the receiver reserved, in both tiers."""
        self.dst.kv.free(self.seq.seq_id)
        if self.dst.batch.tiers is not None:
            self.dst.batch.tiers.release(self.seq.seq_id)

    async def _move(self) -> tuple[HandoffInfo, float]:
        assert self.export is not None
        return await move(self.export, self.dst, self.fresh, self.host)

    async def _after_push(self, timeout_s: float) -> int:
        """Once the push filling the shared blocks has landed: the bytes sent again
        because it failed (0 when it moved them)."""
        assert self.push is not None
        p = self.push
        if await asyncio.wait_for(asyncio.shield(p.landed), timeout_s):
            return 0
        export = submit_export(self.src, self.dst, self.seq, p.first, len(p.block_ids),
                               self.block_size, self.lent)
        info, _ = await asyncio.wait_for(move(export, self.dst, p.block_ids, HostRows(0, [])),
                                         timeout_s)
        return info.nbytes


async def move(export: KVExport, dst: CellWorker, fresh: list[int],
               host: HostRows) -> tuple[HandoffInfo, float]:
    """Once ``export`` is done, import it into ``dst``'s ``fresh`` blocks (and ``host``
    rows); (the export's info, when it was done)."""
    info = await export.ready()
    exported = time.perf_counter()
    await dst.handle.import_kv(export, fresh, host.first_row, host.block_ids)
    return info, exported


def submit_export(src: CellWorker, dst: CellWorker, seq: Sequence, first: int, count: int,
                  block_size: int, lent: LentBlocks | None = None) -> KVExport:
    """Submit the export of ``count`` of the sequence's computed blocks from block
    ``first`` on, through the transport the two workers share; those among ``lent``
    come from the sender's host tier."""
    table = src.kv.block_ids(seq.seq_id)[first:first + count]
    at, lent_ids = (lent.first, lent.block_ids) if lent else (first, [])
    lo, hi = max(first, at), min(first + count, at + len(lent_ids))
    host_ids = lent_ids[lo - at:hi - at] if lo < hi else []
    blocks = table[:lo - first] + table[hi - first:] if host_ids else table
    hashes = src.kv.block_hashes(seq.seq_id)
    n = seq.num_computed_tokens
    counts = [min(block_size, n - i * block_size) for i in range(first, first + count)]
    block_hashes = [hashes[i] if c == block_size and i < len(hashes) else None
                    for i, c in zip(range(first, first + count), counts)]
    plan = plan_handoff(src.ref.place, dst.ref.place, count, lo - first, host_ids)
    return src.handle.export_kv(blocks, block_hashes, counts, plan)
