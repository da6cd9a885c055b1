"""One forward pass of sparse-retrieval attention (``LongContextAttention.step``).

For a step with sparse decodes it gives each layer per-KV-head block tables: the
initial blocks, the top-k middle blocks by summary score, and the local window. In
offload mode the selected middle blocks are first copied from the host tier into the
sequence's recall blocks, unless the recall cache already holds them. Attention then
reads everything in place through those tables (``AttentionMetadata.decode_head_tables``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from kvcache.block_summary import summarize
from kvcache.long_context import KVMode
from workers.ops.base import AttentionMetadata
from workers.recall_cache import RecallCache

if TYPE_CHECKING:
    from workers.sparse_attention import LongContextAttention


@runtime_checkable
class TableSelector(Protocol):
    """A ``BlockSelector`` that also writes its choice into a step's per-head tables
    (``CpuBlockSelector.select_into``): a layer's selection is then one call."""

    def select_into(self, q: torch.Tensor, query_rows: Sequence[int],
                    rows: Sequence[torch.Tensor], ks: Sequence[int],
                    middles: Sequence[torch.Tensor], firsts: Sequence[int],
                    tables: torch.Tensor) -> list[torch.Tensor]:
        ...


@dataclass
class SeqTierState:
    """A long sequence's tiers on this worker (see ``TierChange``).

    ``summaries`` [L, KVH, capacity, V * (D + 2)] holds the summaries of its first
    ``num_summarized`` middle retrieval blocks as (int8) scoring rows (``scoring_rows``),
    combined once when a block joins the middle: a block's keys never change after that,
    and a step then scores the middle without re-reading pool summaries, whether the
    blocks are on the device or not.
    """

    mode: KVMode
    num_prompt_tokens: int
    host_first: int = 0
    host_ids: list[int] = field(default_factory=list)
    recall: RecallCache | None = None
    summaries: torch.Tensor | None = None
    num_summarized: int = 0
    selections: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _SparseRow:
    """One sparse decode row of a step: where its selected blocks go in its table."""

    row: int
    state: SeqTierState
    top_k: int
    first: int            # table column of the first selected block
    middle: torch.Tensor  # [M, r] device blocks (sparse) or host blocks (offload)
    selects: bool         # a step that selects afresh (``LongContextConfig.selects_at``)

    @property
    def scoring_rows(self) -> torch.Tensor:
        """[L, KVH, M, V * (D + 2)]: the middle's summaries in every layer."""
        return self.state.summaries[:, :, :self.middle.shape[0]]


class _Placement:
    """Where the device-resident rows' selected middle blocks go in the step's tables, so
    that a layer writes all of them in one indexed copy instead of a few ops per row.

    A row's selection [KVH, w] (w = min(k, M)) indexes its middle [M, r]; the rows'
    selections side by side, [KVH, sum w], plus ``offset`` index the rows' middles
    stacked (``middle``), and ``dest`` holds each of those pool blocks' flat position in
    the tables [rows, KVH, width]: head h, the row's table from column ``first``.
    """

    def __init__(self, rows: list[_SparseRow], tables: torch.Tensor) -> None:
        self.rows = rows
        dev = tables.device
        _, kvh, width = tables.shape
        r = rows[0].middle.shape[1]
        self.middle = torch.cat([sr.middle for sr in rows]).to(dev)
        sizes = [sr.middle.shape[0] for sr in rows]
        widths = [min(sr.top_k, m) for sr, m in zip(rows, sizes)]
        starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        self.offset = torch.repeat_interleave(starts, torch.tensor(widths)).to(dev)
        heads = torch.arange(kvh)[:, None]
        self.dest = torch.cat([(sr.row * kvh + heads) * width + sr.first + torch.arange(w * r)
                               for sr, w in zip(rows, widths)], dim=1).to(dev)

    def write(self, layer: int, tables: torch.Tensor) -> None:
        chosen = torch.cat([sr.state.selections[layer] for sr in self.rows], dim=1)
        blocks = self.middle[chosen + self.offset]             # [KVH, sum w, r]
        tables.view(-1)[self.dest] = blocks.flatten(1)


class SparseStep:
    """What the model calls around each layer's attention in one forward pass.

    Everything but the selected middle blocks is the same in every layer: the per-head
    tables are laid out once per step (dense rows as their table broadcast over heads,
    sparse rows as initial blocks, room for the selection, local blocks) and each
    layer writes only its selection into them.
    """

    def __init__(self, owner: LongContextAttention, touched_ids: torch.Tensor,
                 touched_counts: torch.Tensor,
                 decodes: list[tuple[SeqTierState | None, int]],
                 meta: AttentionMetadata) -> None:
        self.owner = owner
        self.touched_ids = touched_ids
        self.touched_counts = touched_counts
        self.rows: list[_SparseRow] = []
        self.meta = meta
        if any(st is not None and st.mode is not KVMode.DENSE for st, _ in decodes):
            self.meta = self._layout(decodes, meta)
        # What every layer's selection reads and writes, made once a step.
        self.layer_rows = [sr.scoring_rows.unbind(0) for sr in self.rows]
        self.offloaded = [sr for sr in self.rows if sr.state.mode is KVMode.OFFLOAD]
        # Selection and table write in one call, for steps whose rows are all in the pool:
        # its per-row arguments, made once a step.
        self.fused = (([sr.row for sr in self.rows], [sr.top_k for sr in self.rows],
                       [sr.middle for sr in self.rows], [sr.first for sr in self.rows])
                      if isinstance(owner.selector, TableSelector) and self.rows
                      and not self.offloaded else None)

    @functools.cached_property
    def row_ids(self) -> torch.Tensor:
        """The sparse rows' batch rows, for the layers that select apart from the table
        write (the one-call path takes them as a list)."""
        return torch.as_tensor([sr.row for sr in self.rows],
                               device=self.meta.decode_block_tables.device)

    @functools.cached_property
    def recall_ids(self) -> dict[int, torch.Tensor]:
        """Per offloaded row, its recall blocks [slots, per_block], made once a step (the
        cache grows only between steps)."""
        r = self.owner.per_block
        return {sr.row: torch.tensor(sr.state.recall.block_ids, dtype=torch.long).view(-1, r)
                for sr in self.offloaded}

    @functools.cached_property
    def placement(self) -> _Placement | None:
        """The device-resident rows' table writes, made in the first layer that needs
        them (none does when every layer takes the one-call path)."""
        device_rows = [sr for sr in self.rows if sr.state.mode is not KVMode.OFFLOAD]
        return _Placement(device_rows, self.meta.decode_head_tables) if device_rows else None

    def _layout(self, decodes: list[tuple[SeqTierState | None, int]],
                meta: AttentionMetadata) -> AttentionMetadata:
        o = self.owner
        bs, r, kvh = o.shape.block_size, o.per_block, o.shape.num_kv_heads
        dev = meta.decode_block_tables.device
        parts, lens = [], []
        for i, (st, length) in enumerate(decodes):
            # The row's device table as a tensor (host-tier entries read 0 there, and
            # only the offloaded middle has them): sliced, not rebuilt from the list.
            table = meta.decode_block_tables[i]
            if st is None or st.mode is KVMode.DENSE:
                parts.append((table[:-(-length // bs)], None, None))
                lens.append(length)
                continue
            lay = o.config.layout(length)
            first, m = lay.first_middle * r, lay.num_middle * r
            end = first + m
            start = first + st.num_summarized * r
            if start < end:   # blocks that joined the middle since the last step
                o._extend_summaries(st, o.summaries[:, table[start:end].to(o.summaries.device)])
            if st.mode is KVMode.OFFLOAD:
                off = first - st.host_first
                middle = torch.as_tensor(st.host_ids[off:off + m])
            else:
                middle = table[first:first + m]
            if lay.top_k:   # else no middle yet: initial and local blocks are the context
                self.rows.append(_SparseRow(i, st, lay.top_k, first, middle.view(-1, r),
                                            o.config.selects_at(length - 1,
                                                                st.num_prompt_tokens)))
            parts.append((table[:first], lay.top_k * r,
                          table[lay.local_start // bs:-(-length // bs)]))
            lens.append(lay.num_attended_tokens)
        width = max(len(a) + (b or 0) + (0 if c is None else len(c)) for a, b, c in parts)
        tables = torch.zeros((len(parts), kvh, width), dtype=torch.long, device=dev)
        for i, (head, gap, tail) in enumerate(parts):
            tables[i, :, :len(head)] = head
            if tail is not None:
                tables[i, :, len(head) + gap:len(head) + gap + len(tail)] = tail
        head_lens = torch.tensor(lens, device=dev)[:, None].expand(-1, kvh).contiguous()
        return dataclasses.replace(meta, decode_head_tables=tables, decode_head_lens=head_lens)

    def after_write(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Refresh the summaries of the blocks this step wrote into."""
        if self.touched_ids.numel():
            o = self.owner
            o.summaries[layer].index_copy_(
                0, self.touched_ids,
                summarize(kv_cache[0][self.touched_ids], self.touched_counts,
                          o.config.summary))

    def decode_meta(self, layer: int, q: torch.Tensor,
                    kv_cache: torch.Tensor) -> AttentionMetadata:
        """The step's metadata with this layer's selected blocks in the sparse rows."""
        tables = self.meta.decode_head_tables
        due = [sr for sr in self.rows if not self._reuses(layer, sr)]
        if self.fused is not None and len(due) == len(self.rows):
            rows, ks, middles, firsts = self.fused
            self._keep(layer, due, self.owner.selector.select_into(
                q, rows, [r[layer] for r in self.layer_rows], ks, middles, firsts, tables))
            return self.meta
        self._select(layer, q, due)
        if self.placement is not None:
            self.placement.write(layer, tables)
        for sr in self.offloaded:
            picked = self._recall(layer, sr, sr.state.selections[layer], kv_cache)
            tables[sr.row, :, sr.first:sr.first + picked.shape[1]] = picked
        return self.meta

    def _select(self, layer: int, q: torch.Tensor, due: list[_SparseRow]) -> None:
        """The [KVH, k] middle indices for ``layer`` of the rows that choose in this step
        (``due``; the others reuse theirs), in one selector call."""
        if not due:
            return
        if len(due) == len(self.rows):   # every row, as with reselect_every 1
            queries = q.index_select(0, self.row_ids)
            rows = [r[layer] for r in self.layer_rows]
        else:
            queries = q[torch.as_tensor([sr.row for sr in due], device=q.device)]
            rows = [sr.scoring_rows[layer] for sr in due]
        self._keep(layer, due, self.owner.selector.select(queries, rows,
                                                          [sr.top_k for sr in due]))

    def _keep(self, layer: int, due: list[_SparseRow], chosen: list[torch.Tensor]) -> None:
        """Each row's choice into its state's ``selections``, reused by the steps that do
        not select afresh while the middle keeps its size and k."""
        for sr, c in zip(due, chosen):
            sr.state.selections[layer] = c
        self.owner.stats.selections += len(due)

    def _reuses(self, layer: int, sr: _SparseRow) -> bool:
        last = sr.state.selections.get(layer)
        return (last is not None and not sr.selects
                and last.shape[1] == sr.top_k and int(last.max()) < sr.middle.shape[0])

    def _recall(self, layer: int, sr: _SparseRow, chosen: torch.Tensor,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Device blocks [KVH, k*r] holding the chosen middle blocks, copying in misses."""
        o = self.owner
        cache, recall_ids = sr.state.recall, self.recall_ids[sr.row]
        slots = []
        for head, wanted in enumerate(chosen.tolist()):
            held, copies = cache.place(layer, head, wanted, o._step)
            slots.append(held)
            if copies:
                blocks, targets = zip(*copies)
                o.host.recall(layer, head, kv_cache, sr.middle[list(blocks)].flatten(),
                              recall_ids[list(targets)].flatten().to(kv_cache.device))
            o.stats.recalled_blocks += len(copies) * o.per_block
            o.stats.recall_hits += (len(held) - len(copies)) * o.per_block
        return recall_ids[torch.tensor(slots)].flatten(1).to(kv_cache.device)
