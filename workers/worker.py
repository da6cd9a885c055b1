"""The worker behind a Ray actor: one model runner and one paged KV pool on one device.

A worker makes no decision. It runs the step plans the global scheduler sends
(msgpack bytes in, msgpack bytes out) and, for a KV handoff, exports blocks of its
pool as an Arrow KV batch or scatters a received batch into its pool. The class is
plain Python so that it also runs in one process; ``cluster`` makes it an actor with
the resources its pool asks for. Its role (prefill, decode, mixed) only labels it:
the scheduler decides what it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch

from kvcache.config import CacheConfig
from kvcache.kv_transfer import HostRows, KVLayoutMeta, export_blocks, import_blocks
from kvcache.long_context import LongContextConfig
from scheduler.protocol import Role, StepPlan, decode, encode
from workers.device import resolve_device
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


@dataclass
class WorkerInfo:
    """What the scheduler needs to know about a worker's pool and model."""

    num_blocks: int
    block_size: int
    model_max_len: int
    fingerprint: str
    eos_token_ids: list[int]
    host_blocks: int = 0  # the host tier's blocks (long contexts)


class Worker:
    def __init__(self, spec: WorkerSpec, role: Role | str) -> None:
        self.role = Role.parse(role)
        torch.set_num_threads(spec.num_threads)
        dtype = getattr(torch, spec.dtype)
        ckpt = load_checkpoint(spec.model_path, dtype=dtype, tokenizer=spec.tokenizer)
        model_max = ckpt.config.max_position_embeddings
        self.runner = ModelRunner(ckpt, spec.cache, resolve_device(spec.device),
                                  max_model_len=spec.max_model_len or model_max, dtype=dtype,
                                  seed=spec.seed, ops=spec.ops, long_context=spec.long_context)
        self.meta = KVLayoutMeta.from_shape(self.runner.kv_shape, ckpt.fingerprint)
        eos = set(ckpt.config.eos_token_ids)
        if ckpt.tokenizer is not None:
            eos |= set(ckpt.tokenizer.eos_token_ids)
        lc = self.runner.long_context
        self.info_ = WorkerInfo(self.runner.num_blocks, spec.cache.block_size, model_max,
                                ckpt.fingerprint, sorted(eos), lc.host.num_blocks if lc else 0)

    def info(self) -> WorkerInfo:
        return self.info_

    def step(self, plan: bytes) -> bytes:
        """Run one step plan (msgpack ``StepPlan``); returns the msgpack ``StepOutput``."""
        return encode(self.runner.execute(decode(StepPlan, plan)))

    def export_kv(self, block_ids: list[int], block_hashes: list[bytes | None],
                  token_counts: list[int]) -> tuple[int, pa.RecordBatch]:
        """The blocks as one KV batch, and its payload size. Called with two returns, so
        the scheduler learns the export is done without fetching the batch."""
        lc = self.runner.long_context
        summaries = lc.summaries[:, torch.as_tensor(block_ids)].transpose(0, 1) if lc else None
        batch = export_blocks(self.runner.kv_caches, block_ids, block_hashes, token_counts,
                              self.meta, summaries)
        return batch.nbytes, batch

    def import_kv(self, batch: pa.RecordBatch, block_ids: list[int], host_first_row: int = 0,
                  host_block_ids: list[int] | None = None) -> int:
        """Check a KV batch and scatter it into ``block_ids``, except its rows from
        ``host_first_row`` on, one per ``host_block_ids``, which go to the host tier (a
        sequence arriving in offload mode); returns its payload size.

        Raises ``KVTransferError`` (pool untouched) when the batch does not fit this pool.
        """
        lc = self.runner.long_context
        host = None
        if host_block_ids:
            if lc is None:
                raise ValueError("host_block_ids: this worker has no host tier "
                                 "(long_context is disabled)")
            host = HostRows(host_first_row, host_block_ids, lc.host.kv)
        imported = import_blocks(batch, self.runner.kv_caches, block_ids, self.meta, host)
        if lc is not None:
            lc.receive(self.runner.kv_caches, imported, host)
        return batch.nbytes

    def ping(self) -> str:
        return self.role.value
