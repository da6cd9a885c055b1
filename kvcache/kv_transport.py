"""KV handoff transports: the KV batch describes what moves, a transport carries the bytes.

The scheduler plans a handoff from where the two workers are (``plan_handoff``) and
never touches bytes; the sender exports, the receiver imports and acknowledges by
returning, and only then are the sender's blocks released (they are pinned until then).

- ``SHARED_MEMORY`` (same node, both pools in shared segments): a description of the
  blocks, which the receiver copies straight out of the sender's segments, one copy
  verified as it lands (``kvcache.shm_transport``).
- ``OBJECT_STORE`` (across nodes, or pools outside shared memory): the KV batch with its
  payload, returned by the sender's method so that the caller owns it, in parts of at
  most ``MAX_PART_BYTES`` each so no one object grows past a few hundred MB.
- ``DEVICE`` (both workers name the same Ray Direct Transport, ``tensor_transport``):
  the same description, and the blocks as one tensor on the sender's device that the
  transport carries into the receiver's (``kvcache.device_transport``). Preferred when
  both have one; otherwise the host paths above.

A refused, corrupted or late transfer raises ``KVTransferError`` (or times out) and the
scheduler recomputes the sequence; on a checksum mismatch the receiver's reserved blocks
may hold part of the copy, which is harmless as they are dropped with the reservation.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from kvcache.kv_transfer import (
    KVLayoutMeta,
    KVTransferError,
    _check_token_counts,
    _read_only_tensor,
    _tensor_column,
    _values_view,
    check_metadata,
)
from kvcache.shm_segment import SegmentHandle

MAX_PART_BYTES = 256 << 20


class Transport(enum.Enum):
    SHARED_MEMORY = "shm"
    OBJECT_STORE = "object_store"
    DEVICE = "device"


@dataclass(frozen=True)
class WorkerPlace:
    """Where a worker's pool is, as a transport sees it: plain values that cross processes.

    ``tensor_transport``: the Ray Direct Transport its actor sends and receives block
    tensors through (``nixl``; ``nccl``, ``gloo`` or Ascend's HCCL within a collective
    group its peers share), None where it has none."""

    node_id: str
    block_bytes: int
    segment: SegmentHandle | None = None   # its pool's shared segment (host-memory pools)
    tensor_transport: str | None = None


@dataclass(frozen=True)
class HandoffPlan:
    """How one export is made. Its rows from ``host_first_row`` on, one per
    ``host_block_ids``, come from the sender's host tier (a sequence in offload mode)."""

    transport: Transport
    parts: int   # KV batches the sender returns (object store: each <= MAX_PART_BYTES)
    tensor_transport: str | None = None   # DEVICE: the Ray Direct Transport that carries it
    host_first_row: int = 0
    host_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HandoffInfo:
    """What the sender reports once its export is ready: the scheduler's stats."""

    transport: Transport
    nbytes: int   # KV payload bytes the handoff moves
    tensor_transport: str | None = None   # DEVICE: the Ray Direct Transport

    @property
    def label(self) -> str:
        """The transport as stats name it: ``shm``, ``object_store``, ``device:nixl``..."""
        if self.tensor_transport is None:
            return self.transport.value
        return f"{self.transport.value}:{self.tensor_transport}"


def plan_handoff(src: WorkerPlace | None, dst: WorkerPlace | None, num_blocks: int,
                 host_first_row: int = 0, host_block_ids: Sequence[int] = ()) -> HandoffPlan:
    """A device transport both workers have; else shared memory when both pools are in
    shared segments on one node; else the object store. A worker whose place is unknown
    gets the object store in one part. Rows from the sender's host tier
    (``HandoffPlan``'s) are on no device, so an export with any takes a host path; a
    worker whose pool is in a shared segment has its host tier in one too."""
    host = {"host_first_row": host_first_row, "host_block_ids": tuple(host_block_ids)}
    if src is None or dst is None:
        return HandoffPlan(Transport.OBJECT_STORE, 1, **host)
    if (not host_block_ids and src.tensor_transport is not None
            and src.tensor_transport == dst.tensor_transport):
        return HandoffPlan(Transport.DEVICE, 1, src.tensor_transport)
    if src.node_id == dst.node_id and src.segment is not None and dst.segment is not None:
        return HandoffPlan(Transport.SHARED_MEMORY, 1, **host)
    return HandoffPlan(Transport.OBJECT_STORE,
                       max(1, math.ceil(num_blocks * src.block_bytes / MAX_PART_BYTES)), **host)


def part_bounds(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive row ranges, as even as can be, that cover ``num_rows`` rows."""
    cuts = [num_rows * p // parts for p in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def transport_of(batch: pa.RecordBatch) -> Transport:
    """The transport a KV batch was made for (a batch with its payload: the object store)."""
    sent = (batch.schema.metadata or {}).get(b"transport", b"").decode(errors="replace")
    return Transport(sent) if sent in {t.value for t in Transport} else Transport.OBJECT_STORE


def describe(transport: Transport, meta: KVLayoutMeta, block_hashes: Sequence[bytes | None],
             token_counts: Sequence[int], checksums: np.ndarray,
             summaries: torch.Tensor | None, fields: dict[str, object],
             src: np.ndarray | None = None) -> pa.RecordBatch:
    """A handoff's description: a KV batch without its payload, a row per block (hash,
    token count, the block in the sender's pool when given, checksum, summaries), the
    layout and ``fields`` in its metadata, and a digest over all of it."""
    n = len(checksums)
    if len(block_hashes) != n or len(token_counts) != n:
        raise ValueError(f"KV description: {n} blocks, {len(block_hashes)} hashes and "
                         f"{len(token_counts)} token counts; expected one of each per block")
    _check_token_counts(token_counts, meta.block_size)
    counts = np.asarray(token_counts, dtype=np.int32)
    hashes = list(block_hashes)
    columns = [("block_hash", pa.binary()), ("num_tokens", pa.int32()), ("checksum", pa.uint64())]
    arrays = [pa.array(hashes, type=pa.binary()), pa.array(counts), pa.array(checksums)]
    if src is not None:
        columns.append(("src_block", pa.int32()))
        arrays.append(pa.array(src))
    summary = None
    if summaries is not None:
        summary = np.ascontiguousarray(summaries.float().cpu().numpy()).reshape(n, -1)
        tensor_type = pa.fixed_shape_tensor(pa.float32(), summaries.shape[1:])
        columns.append(("summary", tensor_type))
        arrays.append(_tensor_column(tensor_type, pa.array(summary.reshape(-1)),
                                     summary.shape[1]))
    fields = {"transport": transport.value, **fields,
              "digest": _digest(counts, hashes, checksums, summary, src)}
    metadata = {**meta.metadata(), **{k.encode(): str(v).encode() for k, v in fields.items()}}
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(columns, metadata=metadata))


@dataclass
class Description:
    """A received description, checked against its digest and this pool's layout."""

    counts: np.ndarray
    hashes: list[bytes | None]
    checksums: np.ndarray
    summary: np.ndarray | None   # [rows, summary values] fp32
    src: np.ndarray | None
    metadata: dict[bytes, bytes]   # the batch's schema metadata, checked

    def summaries(self, batch: pa.RecordBatch) -> torch.Tensor | None:
        if self.summary is None:
            return None
        return _read_only_tensor(self.summary).view(
            batch.num_rows, *batch.schema.field("summary").type.shape)


def read_description(batch: pa.RecordBatch, expected_meta: KVLayoutMeta,
                     num_rows: int) -> Description:
    """The description's rows, or KVTransferError when it does not fit this pool (its
    layout, ``num_rows`` rows) or does not match its digest."""
    received = batch.schema.metadata or {}
    check_metadata(received, expected_meta)
    if batch.num_rows != num_rows:
        raise KVTransferError(f"KV description rows: received {batch.num_rows}, expected "
                              f"{num_rows} (one per destination block)")
    try:
        d = Description(batch.column("num_tokens").to_numpy(),
                        batch.column("block_hash").to_pylist(),
                        batch.column("checksum").to_numpy(), None,
                        batch.column("src_block").to_numpy()
                        if "src_block" in batch.schema.names else None, received)
    except (KeyError, pa.ArrowInvalid) as e:
        raise KVTransferError(f"KV description: malformed ({e!r}); expected the columns "
                              "describe() writes") from e
    if "summary" in batch.schema.names:
        d.summary = _values_view(batch.column("summary").storage.flatten()).reshape(
            batch.num_rows, -1)
    digest = _digest(d.counts, d.hashes, d.checksums, d.summary, d.src)
    if received.get(b"digest") != digest.encode():
        raise KVTransferError(f"KV description digest: received {received.get(b'digest')!r}, "
                              f"computed {digest!r}: corrupted in transfer")
    _check_token_counts(d.counts.tolist(), expected_meta.block_size, error=KVTransferError)
    return d


def _digest(counts: np.ndarray, hashes: Sequence[bytes | None], checksums: np.ndarray,
            summaries: np.ndarray | None, src: np.ndarray | None) -> str:
    """BLAKE2b over the description's small columns (the checksums cover the payload)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(counts, dtype="<i4"))
    digest.update(np.ascontiguousarray(checksums, dtype="<u8"))
    if src is not None:
        digest.update(np.ascontiguousarray(src, dtype="<i4"))
    digest.update(b"".join([b"\xff\xff\xff\xff" if h is None else len(h).to_bytes(4, "little") + h
                            for h in hashes]))
    if summaries is not None:
        digest.update(np.ascontiguousarray(summaries, dtype="<f4"))
    return f"blake2b:{digest.hexdigest()}"
