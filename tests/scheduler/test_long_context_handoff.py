"""Handoffs of long sequences in the in-process cell: a sequence whose middle sits in
its worker's host tier finishes there, as a handoff reads only the device pool."""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from kvcache.config import CacheConfig
from kvcache.long_context import LongContextConfig
from scheduler.config import CellConfig, SchedulerConfig
from scheduler.global_scheduler import GlobalScheduler
from scheduler.protocol import Role, SamplingParams
from scheduler.worker_handle import WorkerRef
from tests.scheduler.test_global_scheduler import LocalHandle, _finish
from tests.workers.test_sparse_attention import REGIONS, make_llm
from workers.worker import Worker, WorkerSpec

BLOCK_BYTES = 8192   # the tiny checkpoint's fp32 KV block (16 tokens)


def _cell(path: str, pools: dict[str, tuple[int, int]]) -> GlobalScheduler:
    """A cell of one worker per role, each with (device blocks, host blocks), its
    context length resolved as ``ClusterEngine`` resolves it."""
    refs, limits = [], []
    lc = LongContextConfig(**REGIONS)
    for role, (blocks, host) in pools.items():
        mine = dataclasses.replace(lc, host_kv_bytes=host * BLOCK_BYTES)
        spec = WorkerSpec(path, None, "float32", "cpu", 0, "torch",
                          CacheConfig(kv_cache_bytes=blocks * BLOCK_BYTES), None, 1,
                          long_context=mine)
        worker = Worker(spec, role, "node-a")
        info = worker.info()
        assert (info.num_blocks, info.host_blocks) == (blocks, host)
        refs.append(WorkerRef(f"{role}-0", Role(role), LocalHandle(worker), info.num_blocks,
                              info.host_blocks, info.place))
        limits += [blocks * 16, lc.longest_context(host, 16)]
    return GlobalScheduler(refs, CellConfig(SchedulerConfig(), 16, min(limits),
                                            info.eos_token_ids, long_context=lc))


def test_a_sequence_offloaded_where_it_decodes_finishes_there(tiny_long_factory):
    """The decode worker's host tier holds one sequence's middle and its pool not a
    second whole one, so b, prefilled with a, decodes on the prefill worker, in offload
    mode from its first step. When a finishes, the decode worker has room; b still
    stays: its middle is in the prefill worker's host tier, which no transport reads.
    Both end with the one-process engine's tokens, and no handoff failed."""
    path = tiny_long_factory("llama").path
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, 256, (420,), generator=g).tolist() for _ in range(2))
    params = {"a": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              "b": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)}
    llm = make_llm(path, REGIONS)
    alone = {rid: llm.generate([{"prompt_token_ids": p}], params[rid])[0].outputs[0].token_ids
             for rid, p in (("a", a), ("b", b))}
    gs = _cell(path, {"prefill": (512, 256), "decode": (31, 26)})

    async def main():
        await gs.start()
        for rid, p in (("a", a), ("b", b)):
            await gs.submit(rid, p, params[rid])
        out = await _finish(gs, ["a", "b"])
        stats = await gs.stats()
        await gs.shutdown()
        return out, stats

    out, stats = asyncio.run(main())
    prefill, decode = stats.workers
    assert out == alone
    assert prefill.tier_stats.offloaded_blocks > 0          # b went to offload mode there
    assert (prefill.kv_sent.count, prefill.kv_sent.failures, stats.num_recovered) == (1, 0, 0)
