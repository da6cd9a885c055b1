"""Long sequences moving in the in-process cell: a sequence whose middle sits in its
worker's host tier is handed off like any other, its middle read from that tier, after
a prefill and when its worker drains; one preempted at its first decode step goes on
as it would have, and so does one preempted later."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kvcache.config import CacheConfig
from kvcache.long_context import LongContextConfig
from scheduler.config import CellConfig, SchedulerConfig
from scheduler.global_scheduler import GlobalScheduler
from scheduler.protocol import Role, SamplingParams
from scheduler.stats import WorkerState
from scheduler.worker_handle import WorkerRef
from tests.scheduler.test_global_scheduler import LocalHandle, _finish
from tests.workers.test_sparse_attention import REGIONS, make_llm
from workers.worker import Worker, WorkerSpec

BLOCK_BYTES = 8192   # the tiny checkpoint's fp32 KV block (16 tokens)


def _cell(path: str, pools: list[tuple[str, int, int]], every: int = 1,
          **kw) -> GlobalScheduler:
    """A cell of workers given as (role, device blocks, host blocks), named
    ``{role}-{index}``, its context length resolved as ``ClusterEngine`` resolves it."""
    refs, limits = [], []
    lc = LongContextConfig(**REGIONS, reselect_every=every)
    for i, (role, blocks, host) in enumerate(pools):
        mine = dataclasses.replace(lc, host_kv_bytes=host * BLOCK_BYTES)
        spec = WorkerSpec(path, None, "float32", "cpu", 0, "torch",
                          CacheConfig(kv_cache_bytes=blocks * BLOCK_BYTES), None, 1,
                          long_context=mine)
        worker = Worker(spec, role, "node-a")
        info = worker.info()
        assert (info.num_blocks, info.host_blocks) == (blocks, host)
        refs.append(WorkerRef(f"{role}-{i}", Role(role), LocalHandle(worker), info.num_blocks,
                              info.host_blocks, info.place))
        limits += [blocks * 16, lc.longest_context(host, 16)]
    return GlobalScheduler(refs, CellConfig(SchedulerConfig(), 16, min(limits),
                                            info.eos_token_ids, long_context=lc, **kw))


def test_a_sequence_offloaded_where_it_decodes_moves_once_there_is_room(tiny_long_factory):
    """The decode worker's host tier holds one sequence's middle and its pool not a
    second whole one, so b, prefilled with a, decodes on the prefill worker, in offload
    mode from its first step. When a finishes, the decode worker has room, and b moves
    there with its middle read from the prefill worker's host tier. Both end with the
    one-process engine's tokens, no handoff failed, and both tiers end empty."""
    path = tiny_long_factory("llama").path
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, 256, (420,), generator=g).tolist() for _ in range(2))
    params = {"a": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              "b": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)}
    llm = make_llm(path, REGIONS)
    alone = {rid: llm.generate([{"prompt_token_ids": p}], params[rid])[0].outputs[0].token_ids
             for rid, p in (("a", a), ("b", b))}
    gs = _cell(path, [("prefill", 512, 256), ("decode", 31, 26)])

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
    assert (prefill.kv_sent.count, prefill.kv_sent.failures, stats.num_recovered) == (2, 0, 0)
    # a's middle and b's went straight into the decode worker's host tier: 20 blocks
    # each (32 initial tokens, the local window from token 352 at 421 to 447 tokens)
    assert decode.tier_stats.received_blocks == 2 * 20
    assert prefill.tiers.host_used == decode.tiers.host_used == 0


@pytest.mark.parametrize("every", [1, 3])
def test_a_draining_long_context_worker_moves_its_sequences_in_every_mode(
        tiny_long_factory, every):
    """Two decode workers prefill their own prompts; each gets one dense, one sparse and
    one offloaded sequence. Draining decode-0 after every sequence's first tokens hands
    all three to decode-1 (the offloaded one's middle from decode-0's host tier; the
    sparse one crosses into offload mode on decode-1), all three through shared memory.
    Every text equals the one-process engine's, nothing is recomputed, and decode-0
    leaves the cell."""
    path = tiny_long_factory("llama").path
    g = torch.Generator().manual_seed(5)
    lengths = {"d0": 90, "d1": 100, "s0": 350, "s1": 340, "o0": 420, "o1": 410}
    prompts = {rid: torch.randint(3, 256, (n,), generator=g).tolist()
               for rid, n in lengths.items()}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = make_llm(path, {**REGIONS, "reselect_every": every})
    alone = {rid: llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
             for rid, p in prompts.items()}
    gs = _cell(path, [("decode", 512, 256), ("decode", 512, 256)], every,
               prefill_threshold=1000)

    async def main():
        await gs.start()
        for rid, p in prompts.items():   # placed in turns: decode-0 takes d0, s0, o0
            await gs.submit(rid, p, params)
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        while min(map(len, out.values())) < 2:
            for rid, (ups, _, _) in (await gs.get_updates(sorted(prompts), 5.0)).items():
                out[rid] += [t for u in ups for t in u.new_token_ids]
        drained = gs.workers[0]
        placed = (sorted(s.request_id for s in drained.batch.running),
                  drained.batch.tiers.usage())
        assert await gs.drain("decode-0") is WorkerState.REMOVED
        for rid, tokens in (await _finish(gs, list(prompts))).items():
            out[rid] += tokens
        stats = await gs.stats()
        await gs.shutdown()
        return out, placed, stats

    out, placed, stats = asyncio.run(main())
    names, usage = placed
    assert names == ["d0", "o0", "s0"]
    assert (usage.offloaded_seqs, usage.sparse_seqs, usage.host_used) == (1, 1, 20)
    assert out == alone
    assert (stats.num_migrated, stats.num_recovered) == (3, 0)
    (peer,) = stats.workers
    assert peer.worker_id == "decode-1" and peer.kv_received.failures == 0
    assert peer.tier_stats.received_blocks >= 20     # o0's middle, into its host tier
    assert peer.kv_received.transports == {"shm": 3}   # o0's from decode-0's host tier too
    assert peer.tiers.host_used == 0


@pytest.mark.parametrize("seed, lengths, max_tokens", [
    (2, (63, 448, 532), (14, 31, 44)),    # the 532-token prompt, at its first decode step
    (11, (97, 371, 519), (15, 36, 47)),   # the 519-token prompt, 13 tokens in
], ids=["at-first-decode", "13-tokens-in"])
@pytest.mark.parametrize("every", [1, 3])
def test_a_long_sequence_preempted_goes_on_as_it_would_have(
        tiny_long_factory, seed, lengths, max_tokens, every):
    """One mixed worker whose pool cannot give the longest prompt its recall blocks
    beside the others', so it is preempted while decoding in offload mode and
    recomputed: from the blocks the prefix cache still holds, the rest of its prompt
    prefilled, then each token it had run again as that sparse step
    (``TierPlanner.prefill_stop``). Every text equals the one-process engine's, which
    had room for all three, with the cell's reference ops."""
    path = tiny_long_factory("llama").path
    g = torch.Generator().manual_seed(seed)
    prompts = {f"r{i}": torch.randint(3, 256, (n,), generator=g).tolist()
               for i, n in enumerate(lengths)}
    params = {rid: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for rid, n in zip(prompts, max_tokens)}
    llm = make_llm(path, {**REGIONS, "reselect_every": every}, ops="torch")
    alone = {rid: llm.generate([{"prompt_token_ids": p}], params[rid])[0].outputs[0].token_ids
             for rid, p in prompts.items()}
    gs = _cell(path, [("mixed", 70, 40)], every)

    async def main():
        await gs.start()
        for rid, p in prompts.items():
            await gs.submit(rid, p, params[rid])
        out = await _finish(gs, list(prompts))
        stats = await gs.stats()
        await gs.shutdown()
        return out, stats

    out, stats = asyncio.run(main())
    assert stats.workers[0].num_preemptions >= 1
    assert out == alone
