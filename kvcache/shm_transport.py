"""The ``SHARED_MEMORY`` KV transport (``kvcache.kv_transport``): same node, both pools
in shared segments.

The sender sends only a description, a KV batch without the ``kv`` column whose rows
name the block in the sender's pool (``src_block``) and its checksum (stored when the
block was written: ``BlockChecksums``), and whose metadata names the sender's segment.
The receiver maps that segment once and copies each block straight into its own pool,
taking its CRC32C in the same pass (``block_checksum.copy_verified``), on torch's
threads: one copy, no staging, no object store. A sequence in offload mode reads its
middle from the sender's host tier, whose shared segment the metadata names too
(``SharedHostRows``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from kvcache.block_checksum import BlockChecksums, BlockIdError, copy_verified
from kvcache.kv_tensors import pool_runs
from kvcache.kv_transfer import _WIRE, HostRows, ImportedBlocks, KVLayoutMeta, KVTransferError
from kvcache.kv_transport import Transport, describe, read_description
from kvcache.shm_segment import PeerSegments, SegmentError, SegmentHandle

_SEGMENT_FIELDS = ("pid", "fd", "inode", "nbytes")


def pool_checksums(kv_caches: Sequence[torch.Tensor]) -> BlockChecksums:
    """An empty checksum store for a host pool (``allocate_kv_cache``'s)."""
    return BlockChecksums(_slab_bytes(kv_caches))


@dataclass
class SharedHostRows:
    """Rows of a shared-memory export that the sender reads from its host tier, a
    block-major store at the start of ``segment`` whose ``checksums`` it keeps."""

    rows: HostRows
    segment: SegmentHandle
    checksums: BlockChecksums


def export_shared(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  block_hashes: Sequence[bytes | None], token_counts: Sequence[int],
                  meta: KVLayoutMeta, segment: SegmentHandle, checksums: BlockChecksums,
                  summaries: torch.Tensor | None = None,
                  host: SharedHostRows | None = None) -> pa.RecordBatch:
    """The description of blocks ``block_ids`` of a pool that lies at the start of
    ``segment``, with the ``host`` rows among them: no payload, a checksum per block
    from its store (those stored when the blocks were written; the others hashed now)."""
    slabs = _check_shared_pool(kv_caches, meta, checksums)
    src = np.asarray(block_ids, dtype=np.int32)
    sums = checksums.of(src)
    fields = {"num_blocks": kv_caches[0].shape[1], "block_runs": slabs.shape[0],
              **{f"segment_{k}": getattr(segment, k) for k in _SEGMENT_FIELDS}}
    if host is not None:
        h0, ids = host.rows.first_row, np.asarray(host.rows.block_ids, dtype=np.int32)
        src = np.concatenate([src[:h0], ids, src[h0:]])
        sums = np.concatenate([sums[:h0], host.checksums.of(ids), sums[h0:]])
        fields |= {"host_first_row": h0, "host_rows": len(ids),
                   "host_num_blocks": host.rows.kv.shape[2],
                   **{f"host_segment_{k}": getattr(host.segment, k) for k in _SEGMENT_FIELDS}}
    return describe(Transport.SHARED_MEMORY, meta, block_hashes, token_counts, sums,
                    summaries, fields, src)


def import_shared(batch: pa.RecordBatch, kv_caches: Sequence[torch.Tensor],
                  dst_block_ids: Sequence[int], expected_meta: KVLayoutMeta,
                  peers: PeerSegments, checksums: BlockChecksums,
                  host: HostRows | None = None,
                  host_checksums: BlockChecksums | None = None) -> ImportedBlocks:
    """Copy the described blocks out of the sender's segments (its pool's, and its host
    tier's for the rows the metadata names) into ``dst_block_ids`` (and the ``host``
    rows into host-tier blocks), verifying each block as it lands, on
    ``torch.get_num_threads()`` threads; the pool's ``checksums`` learn the verified ones,
    and so do the host tier's ``host_checksums`` when given (else they are the caller's
    to drop).

    Everything but the payload is checked first; the payload is checked block by block.
    """
    dst = _check_shared_pool(kv_caches, expected_meta, checksums)
    n = len(dst_block_ids) + (len(host.block_ids) if host else 0)
    d = read_description(batch, expected_meta, n)
    if d.src is None:
        raise KVTransferError("KV description: no src_block column; expected the columns "
                              "export_shared writes")
    pool_src, host_src = _sender_segments(d.metadata, dst, peers)
    # Each row's destination (this pool, or this host tier) and source (the sender's).
    rows = np.arange(n)
    none = np.zeros(n, dtype=bool)
    to_host = _rows_in(rows, host.first_row, len(host.block_ids)) if host else none
    from_host = _rows_in(rows, *host_src[1]) if host_src is not None else none
    ids = np.asarray(dst_block_ids, dtype=np.int64)   # the copy checks them, and src's
    dst_ids = np.empty(n, dtype=np.int64)
    dst_ids[~to_host] = ids
    dst_ids[to_host] = host.block_ids if host else []
    stores = ((pool_src, dst), (host_src[0] if host_src is not None else None,
                                _slab_bytes(host.kv.unbind(0)) if host else None))
    src, sums, bad, copies = d.src, d.checksums, None, 0
    try:
        # One copy per pair of stores: sender pool or host tier, into this pool or tier.
        for s_host, d_host in ((0, 0), (1, 0), (0, 1), (1, 1)):
            sel = np.flatnonzero((from_host == s_host) & (to_host == d_host))
            if sel.size:
                bad = copy_verified(stores[s_host][0], src[sel], stores[d_host][1],
                                    dst_ids[sel], sums[sel], torch.get_num_threads())
                copies += 1
                if bad is not None:
                    bad = int(sel[bad])
                    break
    except BlockIdError as e:   # raised before that copy moved a byte
        if copies:   # an earlier one did
            _dropped(checksums, ids, host, host_checksums)
        if e.side == "destination":
            raise   # our own ids: a local bug, not a transfer to recompute
        raise KVTransferError(f"KV description src_block: {e} (the sender's pool or host "
                              "tier)") from e
    if bad is not None:
        _dropped(checksums, ids, host, host_checksums)   # they may hold part of a copy
        raise KVTransferError(f"KV block {bad} (sender block {src[bad]}): its copy does not "
                              f"match checksum {sums[bad]:#018x}: corrupted or "
                              "overwritten in the sender's pool")
    checksums.stored(ids, sums[~to_host])   # each verified as it landed
    if host is not None and host_checksums is not None:
        host_checksums.stored(host.block_ids, sums[to_host])
    return ImportedBlocks(ids.tolist(), d.hashes, d.counts.tolist(), d.summaries(batch))


def _dropped(checksums: BlockChecksums, ids: np.ndarray, host: HostRows | None,
             host_checksums: BlockChecksums | None) -> None:
    """Forget the checksums of the blocks a failed import may have written part of."""
    checksums.written(ids)
    if host is not None and host_checksums is not None:
        host_checksums.written(host.block_ids)


def _rows_in(rows: np.ndarray, first: int, count: int) -> np.ndarray:
    return (rows >= first) & (rows < first + count)


def _sender_segments(received: dict[bytes, bytes], dst: np.ndarray, peers: PeerSegments
                     ) -> tuple[np.ndarray, tuple[np.ndarray, tuple[int, int]] | None]:
    """The sender's pool as ``dst``-shaped slabs, and its host tier's with the rows read
    from it (first, count) when the description has any, from the metadata
    ``export_shared`` writes; KVTransferError when they cannot be mapped or do not fit."""
    def number(key: str) -> int:
        try:
            return int(received[key.encode()])
        except (KeyError, ValueError) as e:
            raise KVTransferError(f"KV description: no segment ({e!r}); expected the "
                                  "metadata export_shared writes") from e

    pool = _mapped(number, "", number("block_runs"), dst, peers)
    if b"host_rows" not in received:
        return pool, None
    host = _mapped(number, "host_", 1, dst, peers)
    return pool, (host, (number("host_first_row"), number("host_rows")))


def _mapped(number: Callable[[str], int], prefix: str, runs: int, dst: np.ndarray,
            peers: PeerSegments) -> np.ndarray:
    """One of the sender's block stores (``prefix``: ``""`` its pool, ``host_`` its host
    tier, block-major) as ``(runs, blocks, run bytes)`` over its mapped segment."""
    segment = SegmentHandle(*(number(f"{prefix}segment_{k}") for k in _SEGMENT_FIELDS))
    num_blocks = number(f"{prefix}num_blocks")
    if runs != dst.shape[0]:
        kind = "host tier" if prefix else "pool"
        raise KVTransferError(f"KV segment: the sender's {kind} holds a block in {runs} runs, "
                              f"this one in {dst.shape[0]}; expected pools of one order "
                              "(allocate_kv_cache's block_major)")
    need = dst.shape[0] * num_blocks * dst.shape[2]
    if need > segment.nbytes:
        raise KVTransferError(f"KV segment: {segment.nbytes} bytes, expected >= {need} for "
                              f"a {'host tier' if prefix else 'pool'} of {num_blocks} blocks")
    try:
        mapped = peers.map(segment)
    except SegmentError as e:
        raise KVTransferError(str(e)) from e
    return np.frombuffer(mapped, dtype=np.uint8, count=need).reshape(dst.shape[0], num_blocks,
                                                                     dst.shape[2])


def _check_shared_pool(kv_caches: Sequence[torch.Tensor], meta: KVLayoutMeta,
                       checksums: BlockChecksums) -> np.ndarray:
    """The pool's byte view from its checksum store, after checking that the store is this
    pool's and the pool is ``meta``'s layout (a local bug if not). The store's view was made
    from the pool (``pool_checksums``), whose layers are slices of one allocation, so its
    start, shape and the first layer's dtype settle it without a pass over the layers."""
    slabs, first = checksums.slabs, kv_caches[0]
    checked = checksums.checked_pool
    if (checked is not None and checked[0] is first and checked[1] == len(kv_caches)
            and (checked[2] is meta or checked[2] == meta)):
        return slabs   # this pool and layout passed below before: each handoff asks twice
    block_bytes = 2 * meta.num_layers * math.prod(meta.layer_block_shape) * (
        _WIRE[meta.dtype][0].itemsize)
    runs, num_blocks, run_bytes = slabs.shape
    if (len(kv_caches) != meta.num_layers or kv_caches[0].dtype != _WIRE[meta.dtype][0]
            or num_blocks != kv_caches[0].shape[1] or runs * run_bytes != block_bytes
            or slabs.ctypes.data != kv_caches[0].data_ptr()):
        raise ValueError(f"kv_caches: {len(kv_caches)} {kv_caches[0].dtype} layers whose "
                         f"checksum store views {slabs.shape} bytes; expected {meta.num_layers} "
                         f"{meta.dtype} layers of {meta.layer_block_shape} blocks and their "
                         f"own store (pool_checksums of kv_caches) of {kv_caches[0].shape[1]} "
                         f"blocks of {block_bytes} bytes")
    checksums.checked_pool = (first, len(kv_caches), meta)
    return slabs


def _slab_bytes(kv_caches: Sequence[torch.Tensor]) -> np.ndarray:
    """The pool as ``(runs, num_blocks, run_bytes)`` bytes (``pool_runs``'s, as
    ``block_checksum`` reads them)."""
    runs = pool_runs(kv_caches)
    if runs is None or kv_caches[0].device.type != "cpu":
        raise ValueError("kv_caches: expected a host pool whose layers are slices of one "
                         "allocation (allocate_kv_cache's) for the shared-memory transport")
    return runs.view(torch.uint8).numpy()
