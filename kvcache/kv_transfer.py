"""The KV batch: an Arrow record batch that hands a sequence's KV blocks to another pool.

One row per block: ``block_hash`` (binary, null for a block not in the prefix cache),
``num_tokens`` (int32) and ``kv``, the block's K and V of every layer as a fixed-shape
tensor ``(num_layers, 2, block_size, kv_heads, head_dim)``. fp16/bf16 travel as their
uint16 bit patterns (numpy and Arrow have no bfloat16), so any value, NaN payloads
included, arrives bit for bit. A sender with long contexts on adds ``summary``, each
block's key summaries of every layer (``kvcache.block_summary``, fp32), so the receiver
need not recompute them. The schema metadata names the layout and a checksum;
the receiver checks all of it before it writes a byte into its pool, because a
mismatched block is silently wrong attention rather than an error. Blocks travel in the
sender's KV layout (ND, or NZ from a 310P pool: ``kv_layout``); a receiver whose pool has
the other layout converts them on import, bit-exactly, so 910/CPU and 310P workers
hand sequences to each other.

Copies: export gathers the blocks into one reused host buffer that Arrow wraps as is;
import reads the tensor column in place (from the Ray object store or an IPC buffer) and
scatters it into the pool (``pool_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType

import numpy as np
import pyarrow as pa
import torch

from kvcache.kv_layout import LAYOUTS, block_shape, convert_blocks
from kvcache.kv_tensors import KVShape, blocks_contiguous
from kvcache.pool_rows import HostRows, block_id_fault, gather_rows, place_rows

FORMAT_VERSION = "2"   # 2: checksum over chunk sums (1: CRC-32)
_CHECKSUM_CHUNK = 64 << 10   # bytes per summed chunk; a multiple of 8

# dtype name -> (pool dtype, Arrow type of the values that carry its bits)
_WIRE: dict[str, tuple[torch.dtype, pa.DataType]] = {
    "float32": (torch.float32, pa.float32()),
    "float16": (torch.float16, pa.uint16()),
    "bfloat16": (torch.bfloat16, pa.uint16()),
    "int8": (torch.int8, pa.int8()),
}
_DTYPE_NAMES = {pool: name for name, (pool, _) in _WIRE.items()}


class KVTransferError(ValueError):
    """A KV batch that must not enter this pool: the sender recomputes instead."""


@dataclass(frozen=True)
class KVLayoutMeta:
    """What a sender and a receiver must agree on for a block to mean the same thing."""

    fingerprint: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_shape(cls, shape: KVShape, fingerprint: str) -> KVLayoutMeta:
        if shape.dtype not in _DTYPE_NAMES:
            raise ValueError(f"kv dtype: got {shape.dtype}; allowed: {', '.join(_WIRE)}")
        return cls(fingerprint, _DTYPE_NAMES[shape.dtype], shape.layout, shape.block_size,
                   shape.num_layers, shape.num_kv_heads, shape.head_dim)

    @property
    def layer_block_shape(self) -> tuple[int, ...]:
        """One block's K (or V) of one layer, in this layout."""
        return block_shape(self.layout, self.block_size, self.num_kv_heads, self.head_dim,
                           _WIRE[self.dtype][0])

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, *self.layer_block_shape)

    def columns(self) -> list[tuple[str, pa.DataType]]:
        kv_type = pa.fixed_shape_tensor(_WIRE[self.dtype][1], self.block_shape)
        return [("block_hash", pa.binary()), ("num_tokens", pa.int32()), ("kv", kv_type)]

    def metadata(self) -> Mapping[bytes, bytes]:
        """The schema metadata naming this layout; each batch adds its checksum. Made
        once per layout (every handoff asks for it twice)."""
        return _layout_metadata(self)


@functools.lru_cache(maxsize=16)
def _layout_metadata(meta: KVLayoutMeta) -> Mapping[bytes, bytes]:
    fields = {"format_version": FORMAT_VERSION, **asdict(meta)}
    return MappingProxyType({k.encode(): str(v).encode() for k, v in fields.items()})


@dataclass
class ImportedBlocks:
    """What the receiver needs to register the imported blocks in its block table."""

    block_ids: list[int]
    block_hashes: list[bytes | None]
    token_counts: list[int]
    summaries: torch.Tensor | None = None   # [rows, L, S, KVH, D] when the batch has them

    @staticmethod
    def join(parts: Sequence[ImportedBlocks]) -> ImportedBlocks:
        """The parts of one handoff (consecutive row ranges) as one."""
        given = [p.summaries for p in parts]
        return ImportedBlocks([i for p in parts for i in p.block_ids],
                              [h for p in parts for h in p.block_hashes],
                              [c for p in parts for c in p.token_counts],
                              torch.cat(given) if all(g is not None for g in given) else None)


def export_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  block_hashes: Sequence[bytes | None], token_counts: Sequence[int],
                  meta: KVLayoutMeta, summaries: torch.Tensor | None = None,
                  host: HostRows | None = None) -> pa.RecordBatch:
    """The blocks ``block_ids`` (in sequence order, any suffix of a sequence) as a KV batch,
    with their ``summaries`` [n, L, S, KVH, D] when given; the ``host`` rows (a sequence
    in offload mode) come from the host tier's blocks."""
    _check_pool(kv_caches, meta)
    n = len(block_ids) + (len(host.block_ids) if host else 0)
    if len(block_hashes) != n or len(token_counts) != n:
        raise ValueError(f"export_blocks: {n} blocks, {len(block_hashes)} hashes and "
                         f"{len(token_counts)} token counts; expected one of each per block")
    _check_token_counts(token_counts, meta.block_size)
    counts = np.asarray(token_counts, dtype=np.int32)

    pool_dtype, value_type = _WIRE[meta.dtype]
    device = kv_caches[0].device
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=device)
    # Row-major (block, layer, k/v, ...): every row is one contiguous tensor cell.
    row_shape = (meta.num_layers, 2, _block_elems(meta))
    flat = _STAGING.take(n * math.prod(row_shape) * pool_dtype.itemsize)
    staged = torch.from_numpy(flat).view(pool_dtype).view(n, *row_shape)
    # The gather writes straight into the rows (no temporary); a device pool is
    # gathered on the device and crosses to the host in one transfer.
    rows = staged if device.type == "cpu" else torch.empty_like(staged, device=device)
    gather_rows(kv_caches, ids, rows, host)
    if rows is not staged:
        staged.copy_(rows)
    flat = flat.view(value_type.to_pandas_dtype())

    hashes = list(block_hashes)
    columns = meta.columns()
    summary = None
    if summaries is not None:
        summary = np.ascontiguousarray(summaries.float().cpu().numpy()).reshape(n, -1)
        columns.append(("summary", pa.fixed_shape_tensor(pa.float32(), summaries.shape[1:])))
    schema = pa.schema(columns, metadata={
        **meta.metadata(), b"checksum": _checksum(flat, counts, hashes, summary).encode()})
    # pa.py_buffer wraps ``flat`` in place and keeps it alive: no copy.
    values = pa.Array.from_buffers(value_type, flat.size, [None, pa.py_buffer(flat)])
    arrays = [pa.array(hashes, type=pa.binary()), pa.array(counts, type=pa.int32()),
              _tensor_column(schema.field("kv").type, values, math.prod(row_shape))]
    if summary is not None:
        arrays.append(_tensor_column(schema.field("summary").type,
                                     pa.array(summary.reshape(-1)), summary.shape[1]))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _tensor_column(tensor_type: pa.DataType, values: pa.Array, row_size: int) -> pa.Array:
    return pa.ExtensionArray.from_storage(tensor_type,
                                          pa.FixedSizeListArray.from_arrays(values, row_size))


def import_blocks(batch: pa.RecordBatch, kv_caches: Sequence[torch.Tensor],
                  dst_block_ids: Sequence[int], expected_meta: KVLayoutMeta,
                  host: HostRows | None = None) -> ImportedBlocks:
    """Write the batch's blocks into ``dst_block_ids`` of this pool, row by row, except
    the ``host`` rows, which go to host-tier blocks.

    Everything is checked first; on any KVTransferError the pool is untouched. A batch
    in the other KV layout is converted (``kv_layout.convert_blocks``) before the scatter.
    """
    _check_pool(kv_caches, expected_meta)
    received = batch.schema.metadata or {}
    # Either layout is accepted (and converted); anything else fails the check.
    sent_layout = received.get(b"layout", b"").decode(errors="replace")
    sender_meta = (dataclasses.replace(expected_meta, layout=sent_layout)
                   if sent_layout in LAYOUTS else expected_meta)
    check_metadata(received, sender_meta)
    num_host = len(host.block_ids) if host else 0
    if batch.num_rows != len(dst_block_ids) + num_host:
        raise KVTransferError(f"KV batch rows: received {batch.num_rows}, expected "
                              f"{len(dst_block_ids) + num_host} (one per destination block)")
    for name, want_type in sender_meta.columns():
        got_type = batch.schema.field(name).type if name in batch.schema.names else None
        if got_type != want_type:
            raise KVTransferError(f"KV batch column {name}: received type {got_type}, "
                                  f"expected {want_type}")
    ids = check_destination(kv_caches, dst_block_ids)

    kv_storage = batch.column("kv").storage
    counts_column = batch.column("num_tokens")
    if kv_storage.null_count or counts_column.null_count:
        raise KVTransferError("KV batch: received null kv or num_tokens, expected none")
    flat = _values_view(kv_storage.flatten())
    counts = counts_column.to_numpy()
    hashes = batch.column("block_hash").to_pylist()
    summary = (_values_view(batch.column("summary").storage.flatten()).reshape(batch.num_rows, -1)
               if "summary" in batch.schema.names else None)
    checksum = _checksum(flat, counts, hashes, summary)
    if received.get(b"checksum") != checksum.encode():
        got = received.get(b"checksum", b"nothing").decode(errors="replace")
        raise KVTransferError(f"KV batch checksum: received {got!r}, computed {checksum!r} "
                              "over the payload: corrupted in transfer")
    _check_token_counts(counts.tolist(), expected_meta.block_size, error=KVTransferError)

    pool_dtype = _WIRE[expected_meta.dtype][0]
    src = _read_only_tensor(flat).view(pool_dtype).view(
        batch.num_rows, expected_meta.num_layers, 2, _block_elems(sender_meta))
    if sender_meta.layout != expected_meta.layout:
        src = convert_blocks(src.view(*src.shape[:3], *sender_meta.layer_block_shape),
                             sender_meta.layout, expected_meta.layout, expected_meta.block_size,
                             expected_meta.num_kv_heads, expected_meta.head_dim
                             ).reshape(*src.shape[:3], _block_elems(expected_meta))
    place_rows(src, kv_caches, ids, host)
    summaries = None
    if summary is not None:
        summaries = _read_only_tensor(summary).view(
            batch.num_rows, *batch.schema.field("summary").type.shape)
    return ImportedBlocks(ids.tolist(), hashes, counts.tolist(), summaries)


def check_destination(kv_caches: Sequence[torch.Tensor],
                      dst_block_ids: Sequence[int]) -> np.ndarray:
    """The destination block ids as an array: distinct, in this pool (a local bug if not)."""
    ids = np.asarray(dst_block_ids, dtype=np.int64)
    fault = block_id_fault(ids, kv_caches[0].shape[1], distinct=True)
    if fault is not None:
        raise ValueError(f"dst_block_ids: {fault}")
    return ids


def check_metadata(received: dict[bytes, bytes], expected_meta: KVLayoutMeta) -> None:
    """Refuse a batch whose schema metadata names another layout than this pool's."""
    for key, want in expected_meta.metadata().items():
        got = received.get(key)
        if got != want:
            raise KVTransferError(
                f"KV batch {key.decode()}: received "
                f"{'nothing' if got is None else repr(got.decode(errors='replace'))}, "
                f"expected {want.decode()!r}")


def to_ipc_bytes(batch: pa.RecordBatch) -> pa.Buffer:
    """The batch as one Arrow IPC stream, for byte transports (a bytes-like pa.Buffer)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def from_ipc_buffer(buf: pa.Buffer | bytes | bytearray | memoryview) -> pa.RecordBatch:
    """The one batch of an IPC stream; its columns point into ``buf`` (no copy)."""
    try:
        batches = list(pa.ipc.open_stream(pa.py_buffer(buf)))
        if len(batches) != 1:
            raise KVTransferError(f"KV IPC stream: received {len(batches)} batches, expected 1")
        batches[0].validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise KVTransferError(f"KV IPC stream: unreadable ({e})") from e
    return batches[0]


def _block_elems(meta: KVLayoutMeta) -> int:
    """Elements of one block's K (or V) in one layer (NZ: padding included)."""
    return math.prod(meta.layer_block_shape)


def _check_pool(kv_caches: Sequence[torch.Tensor], meta: KVLayoutMeta) -> None:
    """The pool in the caller's hands matches ``meta``: a local bug, not a transfer error."""
    layer_shape = (2, kv_caches[0].shape[1], *meta.layer_block_shape)
    dtype = _WIRE.get(meta.dtype, (None,))[0]
    for kv in kv_caches:
        if kv.dtype != dtype or kv.shape != layer_shape or not blocks_contiguous(kv):
            raise ValueError(f"kv_caches: got a {kv.dtype} layer of shape {tuple(kv.shape)}; "
                             f"expected {meta.dtype} (2, num_blocks, "
                             f"{', '.join(map(str, layer_shape[2:]))}) with contiguous blocks")
    if len(kv_caches) != meta.num_layers:
        raise ValueError(f"kv_caches: got {len(kv_caches)} layers; expected {meta.num_layers}")


def _check_token_counts(counts: Sequence[int], block_size: int,
                        error: type[ValueError] = ValueError) -> None:
    """Every block holds 1..block_size tokens. A list and the builtins, not numpy: on the
    cold caches a handoff's copy leaves, numpy's reductions cost several times as much."""
    if counts and (min(counts) < 1 or max(counts) > block_size):
        i = next(i for i, c in enumerate(counts) if not 1 <= c <= block_size)
        raise error(f"num_tokens[{i}]: got {counts[i]}; expected 1..{block_size}")


def _checksum(kv: np.ndarray, counts: np.ndarray, hashes: Sequence[bytes | None],
              summaries: np.ndarray | None = None) -> str:
    """BLAKE2b of the KV payload's 64 KiB chunk sums, then its tail, token counts, hashes
    and summaries (a few percent of the payload, hashed whole).

    It guards against corruption in transit, not forgery (the transport is trusted), and
    must cost far less than a copy: a CRC over the payload ran at 2 GB/s per core, the
    chunk sums (64-bit words added with wrap-around, on torch's threads) at memory speed.
    Any single changed byte changes one word by d * 256**k (0 < |d| < 256, k < 8), which
    is not 0 modulo 2**64, so its chunk's sum changes and with it the hashed sums; the
    order of the addition does not matter, so sender and receiver agree on any machine.
    """
    data = _read_only_tensor(kv.reshape(-1).view(np.uint8))
    whole = data.numel() // 8 * 8
    words = data[:whole].view(torch.int64)
    per_chunk = _CHECKSUM_CHUNK // 8
    full = words.numel() // per_chunk * per_chunk
    sums = torch.cat([words[:full].view(full // per_chunk, per_chunk).sum(dim=1),
                      words[full:].sum().view(1)])
    digest = hashlib.blake2b(sums.numpy().astype("<i8").tobytes(), digest_size=16)
    digest.update(data[whole:].numpy().tobytes())
    digest.update(data.numel().to_bytes(8, "little"))
    digest.update(counts.astype("<i4").tobytes())
    for h in hashes:
        digest.update(b"\xff\xff\xff\xff" if h is None else len(h).to_bytes(4, "little") + h)
    if summaries is not None:
        digest.update(summaries.astype("<f4").tobytes())
    return f"sum64-{_CHECKSUM_CHUNK}-blake2b:{digest.hexdigest()}"


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s memory (Arrow's, often read-only); it is only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class _Staging:
    """The export's host buffer, reused while no batch still holds it.

    A fresh buffer of several hundred MB costs more in page faults than the gather that
    fills it; keeping the last one (as large as the largest export so far) avoids that.
    A batch keeps its rows alive through a view, so a buffer still referenced by one is
    never handed out again: a new one is allocated instead.
    """

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            # References: self._buf and getrefcount's argument; any view adds one.
            if self._buf.size < nbytes or sys.getrefcount(self._buf) > 2:
                self._buf = np.empty(nbytes, dtype=np.uint8)
            return self._buf[:nbytes]


_STAGING = _Staging()


def _values_view(values: pa.Array) -> np.ndarray:
    """The primitive ``values`` as a numpy array over Arrow's own memory."""
    itemsize = values.type.bit_width // 8
    return np.frombuffer(values.buffers()[1], dtype=values.type.to_pandas_dtype(),
                         count=len(values), offset=values.offset * itemsize)
