"""The worker behind a Ray actor: one model runner and one paged KV pool on one device.

A worker makes no decision. It runs the step plans the global scheduler sends
(msgpack bytes in, msgpack bytes out) and, for a KV handoff, exports blocks of its
pool as an Arrow KV batch or copies a received one into its pool, through the transport
the scheduler's plan names (``kvcache.kv_transport``); a host pool lives in a shared
segment, so a peer on the same node copies blocks straight out of it. The class is
plain Python so that it also runs in one process; ``cluster`` makes it an actor with
the resources its pool asks for. Its role (prefill, decode, mixed) only labels it:
the scheduler decides what it runs.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from dataclasses import dataclass

import pyarrow as pa
import torch

from kvcache.config import CacheConfig
from kvcache.device_transport import export_device, import_device
from kvcache.kv_transfer import (
    HostRows,
    ImportedBlocks,
    KVLayoutMeta,
    KVTransferError,
    export_blocks,
    import_blocks,
)
from kvcache.kv_transport import (
    HandoffInfo,
    HandoffPlan,
    Transport,
    WorkerPlace,
    part_bounds,
    transport_of,
)
from kvcache.long_context import LongContextConfig
from kvcache.pool_rows import batch_part
from kvcache.shm_segment import PeerSegments
from kvcache.shm_transport import SharedHostRows, export_shared, import_shared
from scheduler.protocol import Role, StepPlan, decode, encode
from workers.device import resolve_device
from workers.kv_streams import transfer_streams
from workers.loading import load_checkpoint
from workers.model_runner import ModelRunner


@dataclass
class WorkerSpec:
    """What a worker loads and how it sizes itself; plain values, so it crosses processes."""

    model_path: str | None
    tokenizer: str | None
    dtype: str
    device: str
    seed: int
    ops: str
    cache: CacheConfig
    max_model_len: int | None
    num_threads: int
    long_context: LongContextConfig | None = None
    quantization: str = "none"
    enforce_eager: bool = False   # no CUDA graphs
    # The Ray Direct Transport for device-to-device handoffs: None picks what the device
    # has (``device_tensor_transport``), "" none; "nccl" or "gloo" need a collective
    # group of the workers, made by whoever starts them.
    tensor_transport: str | None = None


@dataclass
class WorkerInfo:
    """What the scheduler needs to know about a worker's pool and model."""

    num_blocks: int
    block_size: int
    model_max_len: int
    fingerprint: str
    eos_token_ids: list[int]
    host_blocks: int = 0  # the host tier's blocks (long contexts)
    place: WorkerPlace | None = None   # where its pool is, for the KV transports


class Worker:
    def __init__(self, spec: WorkerSpec, role: Role | str, node_id: str | None = None) -> None:
        """``node_id`` defaults to Ray's node, else this host's name; a worker with another
        node id than a peer's never shares memory with it."""
        self.role = Role.parse(role)
        torch.set_num_threads(spec.num_threads)
        dtype = getattr(torch, spec.dtype)
        ckpt = load_checkpoint(spec.model_path, dtype=dtype, tokenizer=spec.tokenizer)
        model_max = ckpt.config.max_position_embeddings
        self.runner = ModelRunner(ckpt, spec.cache, resolve_device(spec.device),
                                  max_model_len=spec.max_model_len or model_max, dtype=dtype,
                                  seed=spec.seed, ops=spec.ops, long_context=spec.long_context,
                                  shared_pool=True, quantization=spec.quantization,
                                  decode_graph_sizes=() if spec.enforce_eager else None)
        self.meta = KVLayoutMeta.from_shape(self.runner.kv_shape, ckpt.fingerprint)
        eos = set(ckpt.config.eos_token_ids)
        if ckpt.tokenizer is not None:
            eos |= set(ckpt.tokenizer.eos_token_ids)
        self.streams = transfer_streams(self.runner.device)
        lc = self.runner.long_context
        segment = self.runner.kv_segment
        self.peers = PeerSegments()
        transport = (device_tensor_transport(self.runner.device)
                     if spec.tensor_transport is None else spec.tensor_transport or None)
        place = WorkerPlace(node_id or _node_id(), self.runner.kv_shape.bytes_per_block,
                            segment.handle if segment else None, transport)
        # Rows a device-transport export gathered, until send_kv_rows hands them to Ray.
        self._outgoing: dict[tuple[int, ...], torch.Tensor] = {}
        self.info_ = WorkerInfo(self.runner.num_blocks, self.runner.block_size, model_max,
                                ckpt.fingerprint, sorted(eos), lc.host.num_blocks if lc else 0,
                                place)

    def info(self) -> WorkerInfo:
        return self.info_

    def step(self, plan: bytes) -> bytes:
        """Run one step plan (msgpack ``StepPlan``); returns the msgpack ``StepOutput``."""
        step = decode(StepPlan, plan)
        if self.streams is not None:  # sequences arrive by import as new ones
            self.streams.before_step(b for s in step.new for b in s.block_ids)
        return encode(self.runner.execute(step))

    def export_kv(self, block_ids: list[int], block_hashes: list[bytes | None],
                  token_counts: list[int], plan: HandoffPlan | None = None
                  ) -> tuple[HandoffInfo | pa.RecordBatch, ...]:
        """The blocks as ``plan``'s KV batches (default: one, with its payload), after what
        the scheduler learns from: the transport and payload size. Called with one return
        per item, so the scheduler learns the export is done without fetching a batch,
        and owns the batches (the object store frees them with its last reference).
        ``block_ids`` are the pool's rows; the plan's host rows are read from the host
        tier, and then no summaries are sent (those rows' pool summaries went with their
        blocks): the receiver recomputes them all from the keys."""
        plan = plan or HandoffPlan(Transport.OBJECT_STORE, 1)
        lc = self.runner.long_context
        host = None
        if plan.host_block_ids:
            if lc is None or plan.transport is Transport.DEVICE:
                raise ValueError(f"plan: {len(plan.host_block_ids)} rows from the host tier "
                                 f"through {plan.transport.value}; expected a host transport, "
                                 "of a worker with long contexts on")
            host = HostRows(plan.host_first_row, list(plan.host_block_ids), lc.host.kv)
        summaries = (lc.summaries[:, torch.as_tensor(block_ids)].transpose(0, 1)
                     if lc and host is None else None)
        nbytes = len(block_hashes) * self.runner.kv_shape.bytes_per_block
        if plan.transport is Transport.SHARED_MEMORY:
            segment, sums = self.runner.kv_segment, self.runner.kv_checksums
            if segment is None or sums is None:
                raise ValueError("plan: shared memory, but this worker's pool is not in a "
                                 "shared segment (a device pool); plan the object store")
            shared_host = None
            if host is not None:
                host_sums = self.runner.host_checksums
                if lc.host.segment is None or host_sums is None:
                    raise ValueError("plan: host rows through shared memory, but this "
                                     "worker's host tier is not in a shared segment; plan "
                                     "the object store")
                shared_host = SharedHostRows(host, lc.host.segment.handle, host_sums)
            batches = [export_shared(self.runner.kv_caches, block_ids, block_hashes,
                                     token_counts, self.meta, segment.handle, sums, summaries,
                                     shared_host)]
        elif plan.transport is Transport.DEVICE:
            def gather() -> tuple[pa.RecordBatch, torch.Tensor]:
                return export_device(self.runner.kv_caches, block_ids, block_hashes,
                                     token_counts, self.meta, summaries)

            batch, rows = gather() if self.streams is None else self.streams.export(gather)
            self._outgoing[tuple(block_ids)] = rows
            batches = [batch]
        else:
            def copy(a: int, b: int) -> pa.RecordBatch:
                ids, rows_in_host = batch_part(block_ids, host, a, b)
                return export_blocks(self.runner.kv_caches, ids, block_hashes[a:b],
                                     token_counts[a:b], self.meta,
                                     None if summaries is None else summaries[a:b],
                                     rows_in_host)

            batches = [copy(a, b) if self.streams is None
                       else self.streams.export(lambda a=a, b=b: copy(a, b))
                       for a, b in part_bounds(len(block_hashes), plan.parts)]
        return (HandoffInfo(plan.transport, nbytes, plan.tensor_transport), *batches)

    def send_kv_rows(self, block_ids: list[int]) -> torch.Tensor:
        """The rows of a device-transport export of ``block_ids`` (called right after it,
        with Ray's ``tensor_transport`` option: Ray keeps them here and moves them straight
        into the receiver's device when the receiver's ``import_kv`` takes them)."""
        return self._outgoing.pop(tuple(block_ids))

    def import_kv(self, batch: pa.RecordBatch, block_ids: list[int], host_first_row: int = 0,
                  host_block_ids: list[int] | None = None, *more: pa.RecordBatch) -> int:
        """Check a KV handoff's batches (``batch``, then ``more`` parts) and copy them into
        ``block_ids``, except the rows from ``host_first_row`` on, one per
        ``host_block_ids``, which go to the host tier (a sequence arriving in offload
        mode); returns the payload size. Returning is the acknowledgement.

        Raises ``KVTransferError`` when a batch does not fit this pool or a block fails its
        checksum (the pool's other blocks are untouched).
        """
        return self._import((batch, *more), None, block_ids, host_first_row, host_block_ids)

    def import_kv_device(self, batch: pa.RecordBatch, rows: torch.Tensor, block_ids: list[int],
                         host_first_row: int = 0, host_block_ids: list[int] | None = None
                         ) -> int:
        """``import_kv`` of a device transport's description and its ``rows`` (passed by
        position: Ray moves a ``tensor_transport`` argument only there)."""
        return self._import((batch,), rows, block_ids, host_first_row, host_block_ids)

    def _import(self, parts: tuple[pa.RecordBatch, ...], device_rows: torch.Tensor | None,
                block_ids: list[int], host_first_row: int,
                host_block_ids: list[int] | None) -> int:
        lc = self.runner.long_context
        host_ids = host_block_ids or []
        if host_ids and lc is None:
            raise ValueError("host_block_ids: this worker has no host tier "
                             "(long_context is disabled)")
        whole = HostRows(host_first_row, host_ids, lc.host.kv) if host_ids else None
        imported, first = [], 0
        for part in parts:
            ids, host = batch_part(block_ids, whole, first, first + part.num_rows)
            first += part.num_rows
            sums, host_sums = self.runner.kv_checksums, self.runner.host_checksums
            kind = transport_of(part)
            if kind is Transport.SHARED_MEMORY:
                if sums is None:
                    raise ValueError("KV handoff: a shared-memory description, but this "
                                     "worker's pool is not in a shared segment (a device "
                                     "pool); plan the object store")
                imported.append(import_shared(part, self.runner.kv_caches, ids, self.meta,
                                              self.peers, sums, host, host_sums))
                continue
            if kind is Transport.DEVICE:
                if device_rows is None:
                    raise KVTransferError("KV handoff: a device-transport description came "
                                          "without its rows")

                def copy(part=part, ids=ids, host=host) -> ImportedBlocks:
                    return import_device(part, device_rows, self.runner.kv_caches, ids,
                                         self.meta, host)
            else:
                def copy(part=part, ids=ids, host=host) -> ImportedBlocks:
                    return import_blocks(part, self.runner.kv_caches, ids, self.meta, host)
            imported.append(copy() if self.streams is None else self.streams.import_(copy, ids))
            if sums is not None:   # hashed if ever exported again, not on this path
                sums.written(ids)
            if host is not None and host_sums is not None:
                host_sums.written(host.block_ids)
        if lc is not None:
            if self.streams is not None:  # the summaries read the imported blocks
                self.streams.before_step(block_ids)
            lc.receive(self.runner.kv_caches, ImportedBlocks.join(imported), whole)
        return first * self.runner.kv_shape.bytes_per_block

    def ping(self) -> str:
        return self.role.value


def device_tensor_transport(device: torch.device) -> str | None:
    """The Ray Direct Transport a worker on ``device`` uses with no other word: NIXL on
    CUDA when its package is installed (it needs no collective group), on an NPU the
    transport Ascend's Ray integration registered for it, else None (host paths)."""
    if device.type == "cuda":
        return "nixl" if importlib.util.find_spec("nixl") is not None else None
    if device.type == "npu":
        from ray.experimental.rdt.util import transport_manager_info

        return next((name.lower() for name, info in transport_manager_info.items()
                     if "npu" in info.devices), None)
    return None


def _node_id() -> str:
    """Ray's id of this node inside a Ray process, else the host's name (a worker run
    outside Ray, as the CUDA tests do, never imports it)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()
