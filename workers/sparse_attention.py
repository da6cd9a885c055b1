"""The worker's half of sparse-retrieval attention: summaries, selection, recall.

The scheduler decides each sequence's mode and which blocks live in which tier
(``scheduler/tiering.py``); this module does what that implies on the device. It keeps
a summary of every pool block's keys, refreshed as a step writes KV, and, for a step
with sparse decodes, gives each layer per-KV-head block tables: the initial blocks,
the top-k middle blocks by summary score, and the local window. In offload mode the
selected middle blocks are first copied from the host tier into the sequence's recall
blocks, unless the recall cache already holds them. Attention then reads everything in
place through those tables (``AttentionMetadata.decode_head_tables``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvcache.block_summary import ExactSelector, combine, summarize, summary_width
from kvcache.host_tier import HostKVStore
from kvcache.kv_tensors import KVShape
from kvcache.long_context import KVMode, LongContextConfig
from scheduler.protocol import TierChange, TierStats
from workers.ops.base import AttentionMetadata


class RecallCache:
    """A sequence's recall blocks: slots of ``per_block`` device blocks, each holding one
    middle retrieval block per (layer, KV head), reused least recently used first."""

    def __init__(self, per_block: int, num_layers: int, num_heads: int) -> None:
        self.block_ids: list[int] = []
        self.per_block = per_block
        self.num_heads = num_heads
        keys = num_layers * num_heads
        self._slot_of: list[dict[int, int]] = [{} for _ in range(keys)]  # block -> slot
        self._content: list[list[int]] = [[] for _ in range(keys)]       # slot -> block
        self._used: list[list[int]] = [[] for _ in range(keys)]          # slot -> step

    @property
    def slots(self) -> int:
        return len(self.block_ids) // self.per_block

    def grow(self, block_ids: list[int]) -> None:
        self.block_ids.extend(block_ids)
        for content, used in zip(self._content, self._used):
            content.extend([-1] * (self.slots - len(content)))
            used.extend([-1] * (self.slots - len(used)))

    def place(self, layer: int, head: int, wanted: list[int],
              step: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Slots holding ``wanted`` middle blocks, and the (block, slot) pairs to copy in."""
        key = layer * self.num_heads + head
        slot_of, content, used = self._slot_of[key], self._content[key], self._used[key]
        want = set(wanted)
        spare = iter(sorted((s for s in range(self.slots) if content[s] not in want),
                            key=used.__getitem__))
        copies, slots = [], []
        for b in wanted:
            s = slot_of.get(b)
            if s is None:
                s = next(spare)
                slot_of.pop(content[s], None)
                slot_of[b], content[s] = s, b
                copies.append((b, s))
            used[s] = step
            slots.append(s)
        return slots, copies


@dataclass
class SeqTierState:
    """A long sequence's tiers on this worker (see ``SeqTier``)."""

    mode: KVMode
    host_first: int = 0
    host_ids: list[int] = field(default_factory=list)
    recall: RecallCache | None = None
    selections: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    steps: int = 0


class LongContextAttention:
    def __init__(self, config: LongContextConfig, shape: KVShape, num_blocks: int,
                 device: torch.device) -> None:
        config.check_block_size(shape.block_size)
        self.config = config
        self.shape = shape
        self.per_block = config.retrieval_block_size // shape.block_size
        width = summary_width(config.summary)
        self.summaries = torch.zeros((shape.num_layers, num_blocks, width, shape.num_kv_heads,
                                      shape.head_dim), device=device)
        host_blocks = config.host_budget // shape.bytes_per_block
        self.host = HostKVStore(shape, host_blocks, width, device)
        self.selector = ExactSelector(config.summary)
        self.stats = TierStats(host_blocks=host_blocks)
        self._step = 0

    # ---- plan application ----------------------------------------------------------
    def apply(self, state: SeqTierState | None, change: TierChange,
              kv_caches: list[torch.Tensor], block_ids: list[int]) -> SeqTierState:
        """Apply a tier change to a held sequence whose device table is ``block_ids``."""
        if state is None:
            state = SeqTierState(KVMode(change.mode), change.first_offloaded)
        state.mode = KVMode(change.mode)
        if change.host_block_ids:
            if not state.host_ids:
                state.host_first = change.first_offloaded
            self.host.offload(kv_caches, self.summaries, change.offload_block_ids,
                              change.host_block_ids)
            self.stats.offloaded_blocks += len(change.host_block_ids)
            state.host_ids.extend(change.host_block_ids)
            first = change.first_offloaded
            block_ids[first:first + len(change.host_block_ids)] = \
                [-1] * len(change.host_block_ids)
        self._grow_recall(state, change.recall_block_ids)
        return state

    def _grow_recall(self, state: SeqTierState, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if state.recall is None:
            state.recall = RecallCache(self.per_block, self.shape.num_layers,
                                       self.shape.num_kv_heads)
        state.recall.grow(block_ids)

    def summarize_blocks(self, kv_caches: list[torch.Tensor], block_ids: list[int],
                         counts: list[int]) -> None:
        """Summaries of blocks whose KV arrived from elsewhere (a handoff): recomputed from
        their keys, so they are exactly what the sender held."""
        dev = self.summaries.device
        ids = torch.as_tensor(block_ids, device=dev)
        n = torch.as_tensor(counts, device=dev)
        for layer, kv in enumerate(kv_caches):
            self.summaries[layer].index_copy_(0, ids, summarize(kv[0][ids], n,
                                                                self.config.summary))

    # ---- one step ------------------------------------------------------------------
    def step(self, touched: list[tuple[list[int], int, int]],
             decodes: list[tuple[SeqTierState | None, list[int], int]]) -> SparseStep:
        """The hooks of one forward pass. ``touched``: per scheduled sequence, its device
        table and the token range ``[start, end)`` this step writes; ``decodes``: per
        decode row, its tier state, device table and context length."""
        self._step += 1
        bs = self.shape.block_size
        ids, counts = [], []
        for table, start, end in touched:
            for b in range(start // bs, (end - 1) // bs + 1):
                ids.append(table[b])
                counts.append(min(bs, end - b * bs))
        dev = self.summaries.device
        return SparseStep(self, torch.as_tensor(ids, device=dev),
                          torch.as_tensor(counts, device=dev), decodes)


class SparseStep:
    """What the model calls around each layer's attention in one forward pass."""

    def __init__(self, owner: LongContextAttention, touched_ids: torch.Tensor,
                 touched_counts: torch.Tensor,
                 decodes: list[tuple[SeqTierState | None, list[int], int]]) -> None:
        self.owner = owner
        self.touched_ids = touched_ids
        self.touched_counts = touched_counts
        self.decodes = decodes
        self.sparse = any(st is not None and st.mode is not KVMode.DENSE
                          for st, _, _ in decodes)
        for st, _, _ in decodes:
            if st is not None:
                st.steps += 1

    def after_write(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Refresh the summaries of the blocks this step wrote into."""
        if self.touched_ids.numel():
            o = self.owner
            o.summaries[layer].index_copy_(
                0, self.touched_ids,
                summarize(kv_cache[0][self.touched_ids], self.touched_counts,
                          o.config.summary))

    def decode_meta(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                    kv_cache: torch.Tensor) -> AttentionMetadata:
        """``meta`` with per-KV-head tables for the decode rows when any is sparse."""
        if not self.sparse:
            return meta
        kvh = self.owner.shape.num_kv_heads
        rows, lens = [], []
        for i, (st, table, length) in enumerate(self.decodes):
            if st is None or st.mode is KVMode.DENSE:
                nb = -(-length // meta.block_size)
                rows.append(meta.decode_block_tables[i, :nb].expand(kvh, nb))
                lens.append(torch.full((kvh,), length, dtype=torch.long))
            else:
                row, n = self._sparse_row(layer, q[i], st, table, length, kv_cache)
                rows.append(row)
                lens.append(torch.full((kvh,), n, dtype=torch.long))
        width = max(r.shape[1] for r in rows)
        dev = meta.decode_block_tables.device
        tables = torch.zeros((len(rows), kvh, width), dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            tables[i, :, :r.shape[1]] = r
        return dataclasses.replace(meta, decode_head_tables=tables,
                                   decode_head_lens=torch.stack(lens).to(dev))

    def _sparse_row(self, layer: int, q: torch.Tensor, st: SeqTierState, table: list[int],
                    length: int, kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
        """[KVH, blocks] table of one sparse sequence at one layer, and its token count."""
        o = self.owner
        bs, r = o.shape.block_size, o.per_block
        lay = o.config.layout(length)
        first, m = lay.first_middle * r, lay.num_middle * r
        dev = kv_cache.device
        init = torch.as_tensor(table[:first], dtype=torch.long, device=dev)
        local = torch.as_tensor(table[lay.local_start // bs:-(-length // bs)],
                                dtype=torch.long, device=dev)
        if st.mode is KVMode.OFFLOAD:
            off = first - st.host_first
            middle = torch.as_tensor(st.host_ids[off:off + m], dtype=torch.long)
            summaries = o.host.summaries[layer][middle.to(o.summaries.device)]
        else:
            middle = torch.as_tensor(table[first:first + m], dtype=torch.long, device=dev)
            summaries = o.summaries[layer][middle]
        chosen = self._select(layer, q, st, combine(summaries, r, o.config.summary), lay.top_k)
        if st.mode is KVMode.OFFLOAD:
            picked = self._recall(layer, st, chosen, middle, kv_cache)
        else:
            picked = middle.view(-1, r)[chosen].flatten(1)
        kvh = o.shape.num_kv_heads
        row = torch.cat((init.expand(kvh, -1), picked, local.expand(kvh, -1)), dim=1)
        return row, lay.num_attended_tokens

    def _select(self, layer: int, q: torch.Tensor, st: SeqTierState, summaries: torch.Tensor,
                k: int) -> torch.Tensor:
        """[KVH, k] middle indices, reused for ``reselect_every`` steps while the middle
        region keeps its size."""
        o = self.owner
        last = st.selections.get(layer)
        if (last is not None and last[1].shape[1] == k and last[0] == summaries.shape[0]
                and st.steps % o.config.reselect_every):
            return last[1]
        chosen = o.selector.select(q, summaries, k)
        st.selections[layer] = (summaries.shape[0], chosen)
        o.stats.selections += 1
        return chosen

    def _recall(self, layer: int, st: SeqTierState, chosen: torch.Tensor,
                middle_host: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Device blocks [KVH, k*r] holding the chosen middle blocks, copying in misses."""
        o = self.owner
        r, cache = o.per_block, st.recall
        recall_ids = torch.as_tensor(cache.block_ids, dtype=torch.long).view(-1, r)
        host = middle_host.view(-1, r)
        rows = []
        for head in range(chosen.shape[0]):
            slots, copies = cache.place(layer, head, chosen[head].tolist(), o._step)
            if copies:
                blocks = torch.as_tensor([b for b, _ in copies])
                targets = torch.as_tensor([s for _, s in copies])
                o.host.recall(layer, head, kv_cache, host[blocks].flatten(),
                              recall_ids[targets].flatten().to(kv_cache.device))
            o.stats.recalled_blocks += len(copies) * r
            o.stats.recall_hits += (len(slots) - len(copies)) * r
            rows.append(recall_ids[torch.as_tensor(slots)].flatten())
        return torch.stack(rows).to(kv_cache.device)
