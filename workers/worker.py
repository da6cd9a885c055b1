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

import socket
from dataclasses import dataclass

import pyarrow as pa
import ray
import torch

from kvcache.config import CacheConfig
from kvcache.kv_transfer import HostRows, ImportedBlocks, KVLayoutMeta, export_blocks, import_blocks
from kvcache.kv_transport import (
    HandoffInfo,
    HandoffPlan,
    Transport,
    WorkerPlace,
    export_shared,
    import_shared,
    is_shared,
    part_bounds,
)
from kvcache.long_context import LongContextConfig
from kvcache.shm_segment import PeerSegments
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
                                  shared_pool=True, quantization=spec.quantization)
        self.meta = KVLayoutMeta.from_shape(self.runner.kv_shape, ckpt.fingerprint)
        eos = set(ckpt.config.eos_token_ids)
        if ckpt.tokenizer is not None:
            eos |= set(ckpt.tokenizer.eos_token_ids)
        self.streams = transfer_streams(self.runner.device)
        lc = self.runner.long_context
        segment = self.runner.kv_segment
        self.peers = PeerSegments()
        place = WorkerPlace(node_id or _node_id(), self.runner.kv_shape.bytes_per_block,
                            segment.handle if segment else None)
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
        and owns the batches (the object store frees them with its last reference)."""
        plan = plan or HandoffPlan(Transport.OBJECT_STORE, 1)
        lc = self.runner.long_context
        summaries = lc.summaries[:, torch.as_tensor(block_ids)].transpose(0, 1) if lc else None
        nbytes = len(block_ids) * self.runner.kv_shape.bytes_per_block
        if plan.transport is Transport.SHARED_MEMORY:
            segment, sums = self.runner.kv_segment, self.runner.kv_checksums
            if segment is None or sums is None:
                raise ValueError("plan: shared memory, but this worker's pool is not in a "
                                 "shared segment (a device pool); plan the object store")
            batches = [export_shared(self.runner.kv_caches, block_ids, block_hashes,
                                     token_counts, self.meta, segment.handle, sums, summaries)]
        else:
            def copy(a: int, b: int) -> pa.RecordBatch:
                return export_blocks(self.runner.kv_caches, block_ids[a:b], block_hashes[a:b],
                                     token_counts[a:b], self.meta,
                                     None if summaries is None else summaries[a:b])

            batches = [copy(a, b) if self.streams is None
                       else self.streams.export(lambda a=a, b=b: copy(a, b))
                       for a, b in part_bounds(len(block_ids), plan.parts)]
        return (HandoffInfo(plan.transport, nbytes), *batches)

    def import_kv(self, batch: pa.RecordBatch, block_ids: list[int], host_first_row: int = 0,
                  host_block_ids: list[int] | None = None, *more: pa.RecordBatch) -> int:
        """Check a KV handoff's batches (``batch``, then ``more`` parts) and copy them into
        ``block_ids``, except the rows from ``host_first_row`` on, one per
        ``host_block_ids``, which go to the host tier (a sequence arriving in offload
        mode); returns the payload size. Returning is the acknowledgement.

        Raises ``KVTransferError`` when a batch does not fit this pool or a block fails its
        checksum (the pool's other blocks are untouched).
        """
        lc = self.runner.long_context
        host_ids = host_block_ids or []
        if host_ids and lc is None:
            raise ValueError("host_block_ids: this worker has no host tier "
                             "(long_context is disabled)")
        pool_ids = list(block_ids)
        pool_ids[host_first_row:host_first_row] = [-1] * len(host_ids)   # row -> pool block
        imported, first = [], 0
        for part in (batch, *more):
            rows = range(first, first + part.num_rows)
            first += part.num_rows
            in_host = [r for r in rows if host_first_row <= r < host_first_row + len(host_ids)]
            host = (HostRows(in_host[0] - rows.start,
                             host_ids[in_host[0] - host_first_row:in_host[-1] - host_first_row + 1],
                             lc.host.kv) if in_host else None)
            ids = [pool_ids[r] for r in rows if r < len(pool_ids) and pool_ids[r] >= 0]
            sums = self.runner.kv_checksums
            if is_shared(part):
                if sums is None:
                    raise ValueError("KV handoff: a shared-memory description, but this "
                                     "worker's pool is not in a shared segment (a device "
                                     "pool); plan the object store")
                imported.append(import_shared(part, self.runner.kv_caches, ids, self.meta,
                                              self.peers, sums, host))
            elif self.streams is None:
                imported.append(import_blocks(part, self.runner.kv_caches, ids, self.meta, host))
                if sums is not None:   # hashed if ever exported again, not on this path
                    sums.written(ids)
            else:
                imported.append(self.streams.import_(
                    lambda part=part, ids=ids, host=host: import_blocks(
                        part, self.runner.kv_caches, ids, self.meta, host), ids))
        if lc is not None:
            if self.streams is not None:  # the summaries read the imported blocks
                self.streams.before_step(block_ids)
            whole = HostRows(host_first_row, host_ids, lc.host.kv) if host_ids else None
            lc.receive(self.runner.kv_caches, ImportedBlocks.join(imported), whole)
        return first * self.runner.kv_shape.bytes_per_block

    def ping(self) -> str:
        return self.role.value


def _node_id() -> str:
    """Ray's id of this node inside a Ray process, else the host's name."""
    if ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()
