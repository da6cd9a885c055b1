"""Modes and tiers of long sequences on one worker: the scheduler's half of sparse
retrieval (``kvcache.long_context`` has the rule, ``workers/sparse_attention.py`` the
device work).

Before a decode step the batch scheduler asks ``prepare`` to bring a sequence to the
mode its length calls for. In offload mode every middle block the local window has
left behind moves to a host block (its device block is freed at once: the worker copies
it out before the step writes anything), and the sequence gets device blocks for its
recall cache, ``top_k`` retrieval blocks' worth. A sequence's KV is always whole in
exactly one of the two tiers, block by block; finishing, aborting or preempting a
sequence frees both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.block_pool import BlockPool
from kvcache.kv_cache_manager import KVCacheManager
from kvcache.long_context import KVMode, LongContextConfig
from scheduler.protocol import TierChange


@dataclass
class _Tiers:
    mode: KVMode = KVMode.DENSE
    host_first: int = 0
    host_ids: list[int] = field(default_factory=list)
    num_recall: int = 0
    num_received: int = 0   # leading host blocks a handoff filled, not yet told the worker


@dataclass
class LentBlocks:
    """A handed-off sequence's host blocks, which its export reads: table index
    ``first`` on, one per id of ``block_ids``."""

    first: int
    block_ids: list[int]


@dataclass
class TierUsage:
    """Blocks of both tiers, for stats and metrics."""

    host_blocks: int
    host_used: int
    offloaded_seqs: int
    sparse_seqs: int


class TierPlanner:
    def __init__(self, config: LongContextConfig, kv: KVCacheManager, host_blocks: int) -> None:
        config.check_block_size(kv.block_size)
        self.config = config
        self.kv = kv
        self.host = BlockPool(max(host_blocks, 1), enable_caching=False)
        self.host_capacity = host_blocks
        self._per_block = config.retrieval_block_size // kv.block_size
        self._seqs: dict[str, _Tiers] = {}
        self._pending: dict[str, TierChange] = {}

    # ---- admission -----------------------------------------------------------------
    def host_blocks_for(self, num_tokens: int) -> int:
        """Host blocks a sequence of ``num_tokens`` tokens holds in offload mode."""
        if self.config.mode(num_tokens) is not KVMode.OFFLOAD:
            return 0
        return self.config.layout(num_tokens).num_middle * self._per_block

    @property
    def longest_context(self) -> int:
        """Tokens a sequence may hold at most: its middle must fit the whole host tier."""
        return self.config.longest_context(self.host_capacity, self.kv.block_size)

    def admits(self, num_tokens: int) -> bool:
        """Whether the host tier has room for a new sequence of ``num_tokens`` tokens."""
        return self.host_blocks_for(num_tokens + 1) <= self._host_free()

    def prefill_stop(self, num_computed: int, num_tokens: int, num_prompt_tokens: int) -> int:
        """Where a step that computes a sequence of ``num_tokens`` tokens from token
        ``num_computed`` on stops. One with output of its own is being recomputed (after
        a preemption, a lost worker or a failed handoff). In a sparse mode its prefill
        (dense) stops where its first sparse decode step began, and from there each
        token runs again as the sparse decode step it was, one a step, so that its KV is
        written as before and it goes on exactly as an uninterrupted run."""
        if not self._replays(num_tokens, num_prompt_tokens):
            return num_tokens
        return max(self.config.first_sparse_step(num_prompt_tokens), num_computed + 1)

    def replay_start(self, num_cached: int, num_tokens: int, num_prompt_tokens: int) -> int:
        """How many of the ``num_cached`` leading tokens whose KV a recompute of a sequence
        of ``num_tokens`` tokens finds cached it may take: all, unless its replay would
        begin at a sparse step that reused an earlier selection, which the recompute no
        longer has (``LongContextConfig.selects_at``). Then it takes whole blocks up to
        the last one that ends at a selecting step, or at most up to its first sparse
        step."""
        if not self._replays(num_tokens, num_prompt_tokens):
            return num_cached
        first = self.config.first_sparse_step(num_prompt_tokens)
        bs = self.kv.block_size
        while num_cached > first and not self.config.selects_at(num_cached, num_prompt_tokens):
            num_cached = (num_cached - 1) // bs * bs
        return num_cached

    def _replays(self, num_tokens: int, num_prompt_tokens: int) -> bool:
        """Whether a computation of a sequence of ``num_tokens`` tokens is a recompute
        that replays sparse decode steps (not a prompt, nor a dense sequence)."""
        return (num_tokens != num_prompt_tokens
                and self.config.mode(num_tokens) is not KVMode.DENSE)

    def may_move(self, num_tokens: int, num_prompt_tokens: int) -> bool:
        """Whether a running sequence of ``num_tokens`` tokens may move to another worker
        before its next step: unless that step is a sparse one that reuses the last
        selection, which stays with this worker (it moves a step or a few later)."""
        position = num_tokens - 1
        return (self.config.mode(num_tokens) is KVMode.DENSE
                or self.config.selects_at(position, num_prompt_tokens))

    # ---- a handoff -----------------------------------------------------------------
    def middle_to_receive(self, context_len: int) -> tuple[int, int] | None:
        """Table indices [first, end) whose KV a handoff of a sequence about to decode at
        ``context_len`` should write straight into the host tier: its middle, in offload
        mode, when the tier has room (else None: the blocks arrive in the device pool and
        move at the first step)."""
        n = self.host_blocks_for(context_len)
        if n == 0 or n > self._host_free():
            return None
        first = self.config.layout(context_len).init_end // self.kv.block_size
        return first, first + n

    def receive(self, seq_id: str, blocks: tuple[int, int]) -> list[int]:
        """Host blocks for a handoff's middle blocks ``blocks`` (from
        ``middle_to_receive``); the worker learns of them with the sequence's first
        step."""
        first, end = blocks
        ids = self.host.allocate(end - first) or []
        self._seqs[seq_id] = _Tiers(KVMode.DENSE, first, list(ids), num_received=len(ids))
        return ids

    def lend_host_blocks(self, seq_id: str) -> LentBlocks | None:
        """The host blocks of a sequence a handoff takes away (None: it has none): they
        leave the sequence, so that releasing it keeps them, and stay taken until
        ``free_lent`` once the export is done, as its device blocks do."""
        t = self._seqs.get(seq_id)
        if t is None or not t.host_ids:
            return None
        ids, t.host_ids = t.host_ids, []
        return LentBlocks(t.host_first, ids)

    def free_lent(self, lent: LentBlocks) -> None:
        """Give back what ``lend_host_blocks`` lent."""
        self.host.free(reversed(lent.block_ids))

    # ---- a decode step -------------------------------------------------------------
    def prepare(self, seq_id: str, context_len: int) -> bool:
        """Bring a decoding sequence to its mode at ``context_len`` tokens; False when a
        tier lacks room (the host tier: nothing changed; the device pool for recall
        blocks: the offload is done, the recall blocks are not)."""
        mode = self.config.mode(context_len)
        t = self._seqs.get(seq_id)
        if t is None:
            if mode is KVMode.DENSE:
                return True
            t = self._seqs[seq_id] = _Tiers()
        offload, recall = [], 0
        if mode is KVMode.OFFLOAD:
            lay = self.config.layout(context_len)
            bs = self.kv.block_size
            if not t.host_ids:
                t.host_first = lay.init_end // bs
            start = t.host_first + len(t.host_ids)
            offload = list(range(start, lay.local_start // bs))
            recall = lay.top_k * self._per_block - t.num_recall
            if len(offload) > self._host_free():
                return False
        if mode is t.mode and not offload and recall <= 0 and not t.num_received:
            return True
        change = self._pending.setdefault(seq_id, TierChange(seq_id, int(mode)))
        change.mode = int(mode)
        t.mode = mode
        if t.num_received:
            change.first_offloaded = t.host_first
            change.host_block_ids.extend(t.host_ids[:t.num_received])
            change.num_received, t.num_received = t.num_received, 0
        if offload:
            host = self.host.allocate(len(offload)) or []
            device = self.kv.release(seq_id, offload[0], len(offload))
            if not change.host_block_ids:
                change.first_offloaded = offload[0]
            change.offload_block_ids.extend(device)
            change.host_block_ids.extend(host)
            t.host_ids.extend(host)
        if recall > 0:
            # After the offload, whose freed blocks may be what makes room.
            ids = self.kv.allocate_extra(seq_id, recall)
            if ids is None:
                return False   # the offload stands; the caller frees room and asks again
            change.recall_block_ids.extend(ids)
            t.num_recall += recall
        return True

    def take_changes(self) -> list[TierChange]:
        changes = list(self._pending.values())
        self._pending.clear()
        return changes

    def release(self, seq_id: str) -> None:
        """Forget a sequence (finished, aborted, preempted, moved): free its host blocks.
        Its device blocks, recall blocks included, go with ``KVCacheManager``."""
        self._pending.pop(seq_id, None)
        t = self._seqs.pop(seq_id, None)
        if t is not None:
            self.host.free(reversed(t.host_ids))

    def usage(self) -> TierUsage:
        modes = [t.mode for t in self._seqs.values()]
        return TierUsage(self.host_capacity, self.host.num_used_blocks,
                         modes.count(KVMode.OFFLOAD), modes.count(KVMode.SPARSE))

    def _host_free(self) -> int:
        return self.host.num_free_blocks if self.host_capacity else 0
