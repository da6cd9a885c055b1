"""Decode-only steps replayed from CUDA graphs captured once per common batch size.

A decode step of a small batch is dominated by kernel launches; a graph launches the
whole forward pass at once. Graphs have fixed shapes and addresses, so the inputs live in
static buffers of the largest size, a batch runs in the smallest captured size that
holds it, and the rows beyond it are padding: token 0 at position 0, writing its KV into
a pad block the pool keeps for them (never handed to the scheduler) and attending to
that block alone. Block tables are as wide as the longest sequence the model allows, but
each batch size is captured at several table widths (``table_widths``) and a batch runs
in the narrowest that holds its longest sequence: attention that reads every table entry
(the SDPA path) then reads a short batch's blocks, not the whole window's (at an 8K
window, batch 64 ran at 0.47x the speed of 1K-window graphs on an H100 before).

Only CUDA captures graphs (``cuda_capture``); the capture function is a parameter, so the
buffer and padding logic also runs eagerly on the CPU in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workers.ops.base import AttentionMetadata

CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_TABLE_WIDTH = 16   # blocks: the narrowest table captured

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def cuda_capture() -> Capture:
    """A capture function for CUDA: warm up on a side stream, then record one graph per
    call into a memory pool the graphs share (largest first, so the smaller reuse it)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphs:
    def __init__(self, forward: Forward, sizes: Sequence[int], pad_block: int, block_size: int,
                 max_blocks: int, device: torch.device, capture: Capture) -> None:
        self.sizes = sorted(sizes)
        self.block_size, self.pad_block = block_size, pad_block
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), pad_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=device)
        self.widths = table_widths(max_blocks)
        # One table per width (kernels take contiguous tables), shared by the batch sizes.
        self.tables = {w: torch.full((n, w), pad_block, dtype=torch.long, device=device)
                       for w in self.widths}
        self.graphs = {(b, w): capture(lambda b=b, w=w: forward(
            self.input_ids[:b], self.positions[:b], self._meta(b, w)))
            for b in reversed(self.sizes) for w in reversed(self.widths)}

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        return AttentionMetadata(self.slots[:b], b, self.tables[w][:b], self.seq_lens[:b], [],
                                 self.block_size)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.sizes[-1] and width <= self.widths[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch of n sequences."""
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        b = next(s for s in self.sizes if s >= n)
        w = next(w for w in self.widths if w >= width)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:b].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:b].zero_()
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:b].fill_(self.pad_block * self.block_size)
        tables = self.tables[w]
        tables[:b].fill_(self.pad_block)
        tables[:n, :width].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:b].fill_(1)
        return self.graphs[b, w]()[:n]


def table_widths(max_blocks: int) -> list[int]:
    """Block-table widths to capture: doubling from ``MIN_TABLE_WIDTH`` blocks, and the
    widest a sequence can need."""
    widths = [MIN_TABLE_WIDTH]
    while widths[-1] < max_blocks:
        widths.append(widths[-1] * 2)
    return [w for w in widths if w < max_blocks] + [max_blocks]
