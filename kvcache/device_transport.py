"""Device to device: a handoff's blocks as one tensor that a Ray Direct Transport carries.

The sender gathers the blocks into rows ``[n, layers, 2, block elements]`` on its own
device (one op over the pool) and describes them with the shared-memory transport's
description (hashes, token counts, summaries, a checksum per row); the worker returns
the rows from an actor method called with ``tensor_transport`` (NIXL or NCCL on CUDA,
Ascend's HCCL on NPU, gloo between host pools), so Ray moves them straight into the
receiver's device while the description goes through the object store. The receiver
checks the description, the rows' shape and dtype and every row's checksum before it
writes a byte into its pool.

The checksum here is a row's 64-bit words summed with wrap-around, computed on the
device by both sides: one reduction at device-memory speed (CRC32C has no device kernel
in torch), and any single changed byte changes the sum (``kv_transfer._checksum``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch

from kvcache.kv_transfer import (
    ImportedBlocks,
    KVLayoutMeta,
    KVTransferError,
    _block_elems,
    _check_pool,
    check_destination,
)
from kvcache.kv_transport import Transport, describe, read_description
from kvcache.pool_rows import HostRows, gather_rows, place_rows


def export_device(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  block_hashes: Sequence[bytes | None], token_counts: Sequence[int],
                  meta: KVLayoutMeta, summaries: torch.Tensor | None = None
                  ) -> tuple[pa.RecordBatch, torch.Tensor]:
    """The description of blocks ``block_ids`` and their rows on the pool's device."""
    _check_pool(kv_caches, meta)
    device = kv_caches[0].device
    rows = torch.empty((len(block_ids), meta.num_layers, 2, _block_elems(meta)),
                       dtype=kv_caches[0].dtype, device=device)
    gather_rows(kv_caches, torch.as_tensor(block_ids, dtype=torch.long, device=device), rows)
    sums = row_sums(rows).cpu().numpy().view(np.uint64)
    return describe(Transport.DEVICE, meta, block_hashes, token_counts, sums, summaries,
                    {}), rows


def import_device(batch: pa.RecordBatch, rows: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                  dst_block_ids: Sequence[int], expected_meta: KVLayoutMeta,
                  host: HostRows | None = None) -> ImportedBlocks:
    """Write ``rows`` into ``dst_block_ids`` (the ``host`` rows into host-tier blocks) once
    the description, the rows' shape and dtype and every row's checksum are right; on any
    KVTransferError the pool is untouched."""
    _check_pool(kv_caches, expected_meta)
    num_host = len(host.block_ids) if host else 0
    d = read_description(batch, expected_meta, len(dst_block_ids) + num_host)
    want = (batch.num_rows, expected_meta.num_layers, 2, _block_elems(expected_meta))
    if tuple(rows.shape) != want or rows.dtype != kv_caches[0].dtype:
        raise KVTransferError(f"KV rows: received {rows.dtype} {tuple(rows.shape)}, expected "
                              f"{kv_caches[0].dtype} {want}")
    ids = check_destination(kv_caches, dst_block_ids)
    rows = rows.to(kv_caches[0].device)
    got = row_sums(rows).cpu().numpy().view(np.uint64)
    bad = np.flatnonzero(got != d.checksums)
    if bad.size:
        raise KVTransferError(f"KV block {bad[0]}: its rows sum to {got[bad[0]]:#018x}, the "
                              f"sender's to {d.checksums[bad[0]]:#018x}: corrupted in transfer")
    place_rows(rows, kv_caches, ids, host)
    return ImportedBlocks(ids.tolist(), d.hashes, d.counts.tolist(), d.summaries(batch))


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each row's bytes as 64-bit words, summed with wrap-around (int64, on its device)."""
    flat = rows.reshape(rows.shape[0], -1).view(torch.uint8)
    if flat.shape[1] % 8:
        raise ValueError(f"KV rows: {flat.shape[1]} bytes per block; expected a multiple of 8")
    return flat.view(torch.int64).sum(dim=1)
