"""The worker's half of sparse-retrieval attention: summaries, tiers, recall.

The scheduler decides each sequence's mode and which blocks live in which tier
(``scheduler/tiering.py``); this module does what that implies on the device. It keeps
a summary of every pool block's keys, refreshed as a step writes KV, applies the
scheduler's tier changes (offloading middle blocks to the host tier, growing recall
caches), takes in the summaries of a handoff's blocks, and gives each forward pass its
``SparseStep`` (``workers/sparse_step.py``), which lays out the per-KV-head block tables
that attention reads.
"""

from __future__ import annotations

import torch

from kvcache.block_summary import BlockSelector, combine, scoring_rows, summarize, summary_width
from kvcache.host_tier import HostKVStore, KVBlockCopy, copy_kv_blocks
from kvcache.kv_quant import value_width
from kvcache.kv_tensors import KVShape
from kvcache.kv_transfer import HostRows, ImportedBlocks
from kvcache.long_context import KVMode, LongContextConfig
from scheduler.protocol import TierChange, TierStats
from workers.ops.base import AttentionMetadata
from workers.recall_cache import RecallCache
from workers.sparse_step import SeqTierState, SparseStep


class LongContextAttention:
    def __init__(self, config: LongContextConfig, shape: KVShape, num_blocks: int,
                 device: torch.device, selector: BlockSelector,
                 copy: KVBlockCopy = copy_kv_blocks, shared_host: bool = False) -> None:
        """``selector``: the device's exact top-k (``Ops.block_selector``) or an index;
        ``copy``: how blocks move to and from the host tier (``Ops.copy_kv_blocks``);
        ``shared_host``: the host tier in a segment peers copy from (``HostKVStore``)."""
        config.check_block_size(shape.block_size)
        self.config = config
        self.shape = shape
        self.per_block = config.retrieval_block_size // shape.block_size
        self.summaries = torch.zeros((shape.num_layers, num_blocks, summary_width(config.summary),
                                      shape.num_kv_heads, value_width(shape.head_dim, shape.dtype)),
                                     device=device)
        host_blocks = config.host_budget // shape.bytes_per_block
        self.host = HostKVStore(shape, host_blocks, pin=device.type != "cpu", copy=copy,
                                shared=shared_host)
        self.selector = selector
        self.stats = TierStats(host_blocks=host_blocks)
        self._received: dict[int, torch.Tensor | None] = {}   # host block -> its summaries
        self._step = 0

    # ---- plan application ----------------------------------------------------------
    def apply(self, state: SeqTierState | None, change: TierChange,
              kv_caches: list[torch.Tensor], block_ids: list[int],
              num_prompt_tokens: int) -> SeqTierState:
        """Apply a tier change to a held sequence whose device table is ``block_ids``."""
        if state is None:
            state = SeqTierState(KVMode(change.mode), num_prompt_tokens,
                                 change.first_offloaded)
        state.mode = KVMode(change.mode)
        if change.host_block_ids:
            first, n = change.first_offloaded, len(change.host_block_ids)
            if not state.host_ids:
                state.host_first = first
            received = change.host_block_ids[:change.num_received]
            if received:
                self._extend_summaries(state, self._received_summaries(received))
            sources = change.offload_block_ids
            if sources:
                # Summaries are taken while the blocks are still in the device pool, for
                # those not yet in the middle's (a sparse sequence's middle has them).
                summarized = state.host_first + state.num_summarized * self.per_block
                fresh = sources[max(summarized - first - len(received), 0):]
                if fresh:
                    ids = torch.as_tensor(fresh, device=self.summaries.device)
                    self._extend_summaries(state, self.summaries[:, ids])
                self.host.offload(kv_caches, sources, change.host_block_ids[len(received):])
                self.stats.offloaded_blocks += len(sources)
            state.host_ids.extend(change.host_block_ids)
            block_ids[first:first + n] = [-1] * n
        if change.recall_block_ids:
            if state.recall is None:
                state.recall = RecallCache(self.per_block, self.shape.num_layers,
                                           self.shape.num_kv_heads)
            state.recall.grow(change.recall_block_ids)
        return state

    def _extend_summaries(self, state: SeqTierState, pool_summaries: torch.Tensor) -> None:
        """Append the middle retrieval blocks whose pool blocks' summaries [L, n, S, KVH, D]
        come next in the sequence."""
        new = scoring_rows(combine(pool_summaries, self.per_block, self.config.summary))
        layers, kvh, m, width = new.shape
        have = state.num_summarized
        if state.summaries is None or state.summaries.shape[2] < have + m:
            grown = torch.empty((layers, kvh, 2 * (have + m), width), dtype=new.dtype,
                                device=new.device)
            if state.summaries is not None:
                grown[:, :, :have] = state.summaries[:, :, :have]
            state.summaries = grown
        state.summaries[:, :, have:have + m] = new
        state.num_summarized += m

    def summarize_blocks(self, kv_caches: list[torch.Tensor], block_ids: list[int],
                         counts: list[int]) -> None:
        """Summaries of blocks whose KV arrived without them: recomputed from their keys,
        so they are exactly what the sender held."""
        dev = self.summaries.device
        ids = torch.as_tensor(block_ids, device=dev)
        n = torch.as_tensor(counts, device=dev)
        for layer, kv in enumerate(kv_caches):
            self.summaries[layer].index_copy_(0, ids, summarize(kv[0][ids], n,
                                                                self.config.summary))

    def receive(self, kv_caches: list[torch.Tensor], imported: ImportedBlocks,
                host: HostRows | None) -> None:
        """Summaries of a handoff's blocks: those of the pool rows into the pool's, those
        of the host rows kept until their sequence's first step (recomputed from the keys
        when the batch has none)."""
        n = len(imported.token_counts)
        h0, nh = (host.first_row, len(host.block_ids)) if host else (n, 0)
        rows = [i for i in range(n) if not h0 <= i < h0 + nh]
        given = imported.summaries
        if given is not None and given.shape[1:] != self.summaries[:, 0].shape:
            given = None   # another summary kind: recompute
        if given is None:
            counts = [imported.token_counts[i] for i in rows]
            self.summarize_blocks(kv_caches, imported.block_ids, counts)
        elif rows:
            ids = torch.as_tensor(imported.block_ids, device=self.summaries.device)
            self.summaries.index_copy_(1, ids, given[rows].transpose(0, 1).to(ids.device))
        for j, b in enumerate(host.block_ids if host else []):
            self._received[b] = None if given is None else given[h0 + j].clone()
        self.stats.received_blocks += nh

    def _received_summaries(self, host_ids: list[int]) -> torch.Tensor:
        """Pool summaries [L, n, S, KVH, D] of host blocks a handoff filled."""
        kept = [self._received.pop(b, None) for b in host_ids]
        if all(k is not None for k in kept):
            return torch.stack(kept, dim=1).to(self.summaries.device)
        keys = self.host.kv[:, 0, torch.as_tensor(host_ids)]          # [L, n, bs, KVH, D]
        full = torch.full((len(host_ids),), self.shape.block_size)
        return torch.stack([summarize(k, full, self.config.summary) for k in keys]).to(
            self.summaries.device)

    # ---- one step ------------------------------------------------------------------
    def step(self, touched: list[tuple[list[int], int, int]],
             decodes: list[tuple[SeqTierState | None, int]],
             meta: AttentionMetadata) -> SparseStep:
        """The hooks of one forward pass. ``touched``: per scheduled sequence, its device
        table and the token range ``[start, end)`` this step writes; ``decodes``: per
        decode row, its tier state and context length (its table is ``meta``'s row)."""
        self._step += 1
        bs = self.shape.block_size
        ids, counts = [], []
        for table, start, end in touched:
            for b in range(start // bs, (end - 1) // bs + 1):
                ids.append(table[b])
                counts.append(min(bs, end - b * bs))
        dev = self.summaries.device
        return SparseStep(self, torch.as_tensor(ids, device=dev),
                          torch.as_tensor(counts, device=dev), decodes, meta)
