"""Whole KV blocks between a pool and rows ``[n, L, 2, elems]`` (one block per row, its
K and V of every layer): the gather an export starts with and the scatter an import
ends with, for every transport. Each is one ``index_select``/``index_copy_`` over all
layers when the pool is one allocation (``allocate_kv_cache``'s, in either order), else
one per layer; both run on torch's threads and move 16-byte words where the runs allow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.kv_tensors import pool_runs


@dataclass
class HostRows:
    """Rows of a KV batch that go to a host tier's blocks instead of the pool: rows
    ``first_row`` on, one per id of ``block_ids``, into ``kv`` [L, 2, blocks, ...]."""

    first_row: int
    block_ids: list[int]
    kv: torch.Tensor


def block_id_fault(ids: np.ndarray, num_blocks: int, distinct: bool) -> str | None:
    """Why ``ids`` do not name blocks of a pool of ``num_blocks`` (each once, with
    ``distinct``), for an error message; None when they do."""
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        return f"got {ids.min()}..{ids.max()}; expected ids in [0, {num_blocks})"
    if distinct and ids.size and np.bincount(ids).max() > 1:
        return f"got {ids.tolist()}; expected distinct ids"
    return None


def batch_part(block_ids: Sequence[int], host: HostRows | None, start: int,
               end: int) -> tuple[list[int], HostRows | None]:
    """Rows ``[start, end)`` of a KV batch whose rows are pool blocks ``block_ids`` with
    the ``host`` rows among them: that part's pool blocks and its host rows (counted
    from ``start``). Rows past the blocks given name none (a batch too long for them
    fails its import's checks)."""
    h0, nh = (host.first_row, len(host.block_ids)) if host else (end, 0)
    lo, hi = max(start, h0), min(end, h0 + nh)
    ids = [block_ids[i] for i in (r if r < h0 else r - nh for r in range(start, end)
                                  if not h0 <= r < h0 + nh) if i < len(block_ids)]
    part = HostRows(lo - start, host.block_ids[lo - h0:hi - h0], host.kv) \
        if host and lo < hi else None
    return ids, part


def gather_rows(kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, rows: torch.Tensor,
                host: HostRows | None = None) -> None:
    """Blocks ``ids`` (on the pool's device) into ``rows`` [n, L, 2, elems], on that
    device, except the ``host`` rows, which come from host-tier blocks."""
    if host is not None:
        h0, nh = host.first_row, len(host.block_ids)
        for part_ids, part_rows in ((ids[:h0], rows[:h0]), (ids[h0:], rows[h0 + nh:])):
            if part_ids.numel():
                gather_rows(kv_caches, part_ids, part_rows)
        picked = host.kv.index_select(2, torch.as_tensor(host.block_ids))
        rows[h0:h0 + nh].view(nh, *host.kv.shape[:2], *host.kv.shape[3:]).copy_(
            picked.permute(2, 0, 1, 3, 4, 5))
        return
    row_words = as_words(rows)
    slabs = pool_slabs(kv_caches)
    if slabs is not None:
        torch.index_select(slabs, 0, slab_ids(ids, slabs, kv_caches),
                           out=row_words.view(-1, slabs.shape[-1]))
    else:
        for layer, kv in enumerate(kv_caches):
            for kind, slab in enumerate(as_words(kv.flatten(2))):
                torch.index_select(slab, 0, ids, out=row_words[:, layer, kind])


def place_rows(src: torch.Tensor, kv_caches: Sequence[torch.Tensor], ids: np.ndarray,
               host: HostRows | None) -> None:
    """Rows [n, L, 2, elems] into pool blocks ``ids``, except the ``host`` rows, which go
    to host-tier blocks."""
    num_host = len(host.block_ids) if host else 0
    h0 = host.first_row if host else src.shape[0]
    scatter_rows(torch.cat((src[:h0], src[h0 + num_host:])) if num_host else src, kv_caches, ids)
    if host:
        rows = src[h0:h0 + num_host].to(host.kv.device).view(
            num_host, *host.kv.shape[:2], *host.kv.shape[3:])
        host.kv.index_copy_(2, torch.as_tensor(host.block_ids), rows.permute(1, 2, 0, 3, 4, 5))


def scatter_rows(src: torch.Tensor, kv_caches: Sequence[torch.Tensor], ids: np.ndarray) -> None:
    """Rows [n, L, 2, elems] into blocks ``ids`` of the pool."""
    device = kv_caches[0].device
    src_words = as_words(src.to(device))
    device_ids = torch.from_numpy(ids).to(device)
    slabs = pool_slabs(kv_caches)
    if slabs is not None:
        slabs.index_copy_(0, slab_ids(device_ids, slabs, kv_caches),
                          src_words.view(-1, slabs.shape[-1]))
    else:
        for layer, kv in enumerate(kv_caches):
            for kind, slab in enumerate(as_words(kv.flatten(2))):
                slab.index_copy_(0, device_ids, src_words[:, layer, kind])


def pool_slabs(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The pool's ``pool_runs`` as one ``(runs * num_blocks, words)`` view, or None when
    the layers are not one allocation.

    Over it a handoff is one torch op, whose threads start and join once: per layer and
    K/V, 60 ops on the default model, each stalled by a thread the shared machine did not
    schedule, took 10x longer under load. Over small slices torch's index_select copies
    each with one memcpy.
    """
    runs = pool_runs(kv_caches)
    if runs is None:
        return None
    # Words as wide as a slab allows, as the rows [n, L, 2, elems] are read.
    slabs = runs.view(*runs.shape[:2], -1, math.prod(kv_caches[0].shape[2:]))
    return as_words(slabs).view(runs.shape[0] * runs.shape[1], -1)


def slab_ids(block_ids: torch.Tensor, slabs: torch.Tensor,
             kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows of ``pool_slabs`` that hold the blocks, in row order (block, then its runs)."""
    num_blocks = kv_caches[0].shape[1]
    runs = slabs.shape[0] // num_blocks
    if runs == 1:
        return block_ids
    starts = torch.arange(runs, device=block_ids.device) * num_blocks
    return (block_ids[:, None] + starts[None, :]).reshape(-1)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dimension read as the widest words (16 bytes down to 1) that
    divide it. torch's CPU index copies move one element per step, so 16-byte words
    scatter fp16 slabs about 1.5x faster than 2-byte ones; other devices keep the dtype,
    whose kernels they are known to have."""
    if t.device.type != "cpu":
        return t
    nbytes = t.shape[-1] * t.element_size()
    word = next(w for w in (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)
                if nbytes % w.itemsize == 0)
    return t.view(word)
