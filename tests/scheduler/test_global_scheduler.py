"""The global scheduler in one process: its workers are in-process ``Worker``s behind
``WorkerHandle``s, so placement and handoff run deterministically.

Calls to one handle run in submission order, one at a time, as Ray runs a synchronous
actor's calls; a killed worker fails every call with ``WorkerLostError``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvcache.config import CacheConfig
from kvcache.kv_transport import HandoffInfo, HandoffPlan
from scheduler.config import CellConfig, SchedulerConfig
from scheduler.global_scheduler import GlobalScheduler, OverloadedError
from scheduler.protocol import Role, SamplingParams
from scheduler.stats import CellStats, WorkerState
from scheduler.worker_handle import WorkerLostError, WorkerRef
from workers.worker import Worker, WorkerSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@dataclass
class _LocalExport:
    task: asyncio.Task

    async def ready(self) -> HandoffInfo:
        info, *_ = await self.task
        return info


class LocalHandle:
    """A ``WorkerHandle`` over an in-process ``Worker``. Each call is a task, started in
    call order and run one at a time, so a caller yields while its call waits."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.dead = False
        self.lock = asyncio.Lock()

    def _call(self, name: str, *args: Any) -> asyncio.Task:
        async def run() -> Any:
            async with self.lock:
                await asyncio.sleep(0)
                if self.dead:
                    raise WorkerLostError("killed")
                return getattr(self.worker, name)(*args)

        return asyncio.get_running_loop().create_task(run())

    async def step(self, plan: bytes) -> bytes:
        return await self._call("step", plan)

    def export_kv(self, block_ids: list[int], block_hashes: list[bytes | None],
                  token_counts: list[int], plan: HandoffPlan) -> _LocalExport:
        return _LocalExport(self._call("export_kv", block_ids, block_hashes, token_counts,
                                       plan))

    async def import_kv(self, export: _LocalExport, block_ids: list[int],
                        host_first_row: int, host_block_ids: list[int]) -> int:
        _, batch, *more = await export.task
        return await self._call("import_kv", batch, block_ids, host_first_row,
                                host_block_ids, *more)

    async def ping(self) -> None:
        await self._call("ping")


def _worker(path: str, role: str, kv_dtype: str = "auto", node_id: str = "node-a") -> Worker:
    cache = CacheConfig(kv_cache_bytes=1 << 20, kv_dtype=kv_dtype)
    return Worker(WorkerSpec(path, None, "float32", "cpu", 0, "torch", cache, None, 1), role,
                  node_id)


def _scheduler(path: str, roles: list[str], kv_dtypes: dict[int, str] | None = None,
               node_ids: dict[int, str] | None = None, batch: SchedulerConfig | None = None,
               **kw: Any) -> tuple[GlobalScheduler, list[LocalHandle]]:
    handles, refs = [], []
    for i, role in enumerate(roles):
        worker = _worker(path, role, (kv_dtypes or {}).get(i, "auto"),
                         (node_ids or {}).get(i, "node-a"))
        handles.append(LocalHandle(worker))
        info = worker.info()
        refs.append(WorkerRef(f"{role}-{i}", Role(role), handles[-1], info.num_blocks, 0,
                              info.place))
    info = handles[0].worker.info()
    gs = GlobalScheduler(refs, CellConfig(batch or SchedulerConfig(), 16, 512,
                                          info.eos_token_ids, **kw))
    return gs, handles


async def _finish(gs: GlobalScheduler, rids: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r: [] for r in rids}
    left = set(rids)
    while left:
        for rid, (updates, done, error) in (await gs.get_updates(sorted(left), 5.0)).items():
            assert error is None
            for u in updates:
                out[rid].extend(u.new_token_ids)
            if done:
                left.discard(rid)
    return out


async def _serve(gs: GlobalScheduler,
                 prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], CellStats]:
    """Start ``gs``, run ``prompts`` greedily to the end, shut it down: the tokens per
    request and the cell's stats."""
    await gs.start()
    for rid, p in prompts.items():
        await gs.submit(rid, p, GREEDY)
    out = await _finish(gs, list(prompts))
    stats = await gs.stats()
    await gs.shutdown()
    return out, stats


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 250 + 3 for i in range(n)]


def test_placement_prefers_the_prefix_holder_then_load_and_short_prompts_skip_prefill(
        tiny_factory):
    path = tiny_factory("llama").path

    async def main() -> None:
        gs, _ = _scheduler(path, ["prefill", "prefill", "decode"], prefill_threshold=16)
        await gs.start()
        a, b = _prompt(1, 48), _prompt(2, 48)
        await gs.submit("a", a, GREEDY)   # both prefill workers empty: the first
        await gs.submit("b", b, GREEDY)   # prefill-0 holds one: the other
        assert [gs.requests[r].worker.worker_id for r in "ab"] == ["prefill-0",
                                                                  "prefill-1"]
        await _finish(gs, ["a", "b"])
        await gs.submit("b2", b[:40] + [5, 6, 7, 8], GREEDY)   # b's blocks sit on prefill-1
        await gs.submit("short", [9, 10, 11], GREEDY)          # under the threshold
        assert gs.requests["b2"].worker.worker_id == "prefill-1"
        assert gs.requests["short"].worker.worker_id == "decode-2"
        await _finish(gs, ["b2", "short"])
        stats = await gs.stats()
        assert stats.workers[1].prefix_hit_rate > 0
        await gs.shutdown()

    asyncio.run(main())


def test_refused_batch_is_recomputed_on_the_decode_side(tiny_factory):
    """A decode pool with another KV dtype refuses every batch; each sequence is then
    recomputed there and ends with the text a matching pool gives."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 20 + 9 * i) for i in range(4)}

    async def run(kv_dtypes: dict[int, str]) -> tuple[dict[str, list[int]], CellStats]:
        gs, _ = _scheduler(path, ["prefill", "decode"], kv_dtypes)
        return await _serve(gs, prompts)

    async def main() -> None:
        good, good_stats = await run({})
        assert good_stats.workers[0].kv_sent.count == len(prompts)
        refused, stats = await run({1: "float16"})
        assert stats.workers[0].kv_sent.failures == len(prompts)
        assert stats.num_recovered == len(prompts)
        assert all(w.num_used_blocks == 0 for w in stats.workers)
        # fp16 KV on the decode side changes the arithmetic, so compare lengths and the
        # tokens sampled on the prefill side before the handoff was refused.
        assert {r: (len(t), t[0]) for r, t in refused.items()} == \
            {r: (len(t), t[0]) for r, t in good.items()}

    asyncio.run(main())


def test_handoffs_share_memory_on_one_node_and_take_the_object_store_across_nodes(
        tiny_factory):
    """Prefill and decode on one node hand off through shared memory; a decode worker on
    another node id gets the object store; either way every sequence continues with the
    tokens one mixed worker produces alone."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 20 + 9 * i) for i in range(4)}

    async def run(roles: list[str], node_ids: dict[int, str]) -> tuple[dict, CellStats]:
        gs, _ = _scheduler(path, roles, node_ids=node_ids)
        return await _serve(gs, prompts)

    async def main() -> None:
        alone, _ = await run(["mixed"], {})
        for node_ids, transport in (({}, "shm"), ({1: "node-b"}, "object_store")):
            out, stats = await run(["prefill", "decode"], node_ids)
            sent, received = stats.workers[0].kv_sent, stats.workers[1].kv_received
            assert sent.transports == received.transports == {transport: len(prompts)}
            assert sent.failures == 0 and out == alone

    asyncio.run(main())


def test_a_block_corrupted_in_the_senders_pool_after_export_is_recomputed(tiny_factory):
    """A byte flipped in the prefill worker's shared pool between its export and the
    decode worker's copy fails that block's checksum: each handoff is refused and its
    sequence recomputed on the decode side, ending with the tokens of a clean run."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 20 + 9 * i) for i in range(3)}

    async def run(corrupt: bool) -> tuple[dict, CellStats]:
        gs, handles = _scheduler(path, ["prefill", "decode"])
        sender = handles[0].worker
        export = sender.export_kv

        def export_then_corrupt(block_ids, *args):
            out = export(block_ids, *args)
            if corrupt:
                sender.runner.kv_caches[-1][1, block_ids[-1]].view(torch.uint8).view(-1)[7] ^= 1
            return out

        sender.export_kv = export_then_corrupt
        return await _serve(gs, prompts)

    async def main() -> None:
        clean, clean_stats = await run(False)
        assert clean_stats.workers[0].kv_sent.transports == {"shm": len(prompts)}
        out, stats = await run(True)
        assert stats.workers[0].kv_sent.failures == len(prompts)
        assert stats.num_recovered == len(prompts)
        assert all(w.num_used_blocks == 0 for w in stats.workers)
        assert out == clean

    asyncio.run(main())


def test_lost_worker_sequences_move_and_overload_is_immediate(tiny_factory):
    path = tiny_factory("llama").path

    async def main() -> None:
        gs, actors = _scheduler(path, ["mixed", "mixed"], max_waiting=2)
        await gs.start()
        await gs.submit("a", _prompt(1, 30), GREEDY)   # no loop has run yet: both wait
        await gs.submit("b", _prompt(2, 30), GREEDY)
        with pytest.raises(OverloadedError, match=r"2 requests are waiting .*max_waiting=2"):
            await gs.submit("c", _prompt(3, 30), GREEDY)
        actors[0].dead = True
        out = await _finish(gs, ["a", "b"])
        assert [len(t) for t in out.values()] == [6, 6]
        stats = await gs.stats()
        assert [w.state for w in stats.workers] == [WorkerState.LOST, WorkerState.SERVING]
        assert stats.num_recovered == 1 and stats.workers[1].num_used_blocks == 0
        await gs.shutdown()

    asyncio.run(main())


def test_a_prefill_backlog_is_shared_with_the_decode_worker_by_cost(tiny_factory):
    """Past ``max_prefill_queue_tokens`` waiting on the prefill worker, each prompt goes
    where it costs least: the prefill tokens queued there plus its own, counted once more
    for every sequence the worker decodes (hand-counted below); outputs stay greedy."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 40) for i in range(6)}
    long_run = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run(decoding: bool = False, **kw: Any) -> tuple[list[str], dict]:
        gs, _ = _scheduler(path, ["prefill", "decode"], prefill_threshold=8, **kw)
        await gs.start()
        if decoding:   # a short prompt decodes on the decode worker meanwhile
            await gs.submit("busy", [5, 6, 7], long_run)
            while not (await gs.get_updates(["busy"], 5.0)):
                pass
        for rid, p in prompts.items():   # no step runs in between: queues only grow
            await gs.submit(rid, p, GREEDY)
        placed = [gs.requests[r].worker.worker_id[0] for r in prompts]
        if decoding:
            await gs.abort("busy")
        out = await _finish(gs, list(prompts))
        await gs.shutdown()
        return placed, out

    # Idle decode worker, (prefill, decode) costs of each prompt from r2 on, the first
    # two being under the limit of 64: (120, 40) (120, 80) (120, 120): a tie, prefill
    # first, (160, 120).
    idle, out = asyncio.run(run(max_prefill_queue_tokens=64))
    assert "".join(idle) == "ppddpd"
    # One sequence decoding there doubles a prompt's cost on the decode worker:
    # (120, 80) (120, 120) (160, 120) (160, 160).
    busy, busy_out = asyncio.run(run(decoding=True, max_prefill_queue_tokens=64))
    assert "".join(busy) == "ppdpdp"
    unbounded, expected = asyncio.run(run())
    assert "".join(unbounded) == "pppppp"
    assert out == busy_out == expected


def test_a_drained_worker_hands_its_running_sequences_to_its_peer(tiny_factory):
    """Draining a decode worker mid-generation moves each running sequence's KV to the
    other one (no recompute): every text equals a one-worker run's, the drained worker
    leaves the cell, and the peer ends with every block free."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 20 + 3 * i) for i in range(8)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run(roles: list[str], drain: str | None) -> tuple[dict, CellStats, int]:
        gs, _ = _scheduler(path, roles, prefill_threshold=1000)
        await gs.start()
        for rid, p in prompts.items():
            await gs.submit(rid, p, params)
        out: dict[str, list[int]] = {r: [] for r in prompts}
        moved = 0
        if drain is not None:   # once every sequence has its first tokens
            while min(map(len, out.values())) < 2:
                for rid, (ups, _, _) in (await gs.get_updates(sorted(prompts), 5.0)).items():
                    out[rid] += [t for u in ups for t in u.new_token_ids]
            moved = len(next(w for w in gs.workers if w.worker_id == drain).batch.running)
            assert await gs.drain(drain) is WorkerState.REMOVED
        for rid, tokens in (await _finish(gs, list(prompts))).items():
            out[rid] += tokens
        stats = await gs.stats()
        await gs.shutdown()
        return out, stats, moved

    async def main() -> None:
        expected, _, _ = await run(["decode"], None)
        out, stats, moved = await run(["decode", "decode"], "decode-0")
        assert out == expected
        assert moved > 0 and stats.num_migrated == moved and stats.num_recovered == 0
        assert [w.worker_id for w in stats.workers] == ["decode-1"]
        assert stats.workers[0].num_used_blocks == 0

    asyncio.run(main())


def test_an_added_worker_takes_work_and_the_last_one_cannot_be_drained(tiny_factory):
    path = tiny_factory("llama").path

    async def main() -> None:
        gs, handles = _scheduler(path, ["mixed"])
        await gs.start()
        with pytest.raises(ValueError, match="'mixed-0' is the last serving worker"):
            await gs.drain("mixed-0")
        with pytest.raises(ValueError, match=r"'nope' is not a live worker .*live: mixed-0"):
            await gs.drain("nope")
        await gs.submit("a", _prompt(1, 40), SamplingParams(max_tokens=50, ignore_eos=True))
        worker = _worker(path, "mixed")
        ref = WorkerRef("mixed-1", Role.MIXED, LocalHandle(worker), worker.info().num_blocks)
        with pytest.raises(ValueError, match="'mixed-1' is already"):
            await gs.add_worker(ref)
            await gs.add_worker(ref)
        await gs.submit("b", _prompt(2, 40), GREEDY)   # the least loaded: the new one
        assert gs.requests["b"].worker.worker_id == "mixed-1"
        await _finish(gs, ["a", "b"])
        await gs.shutdown()

    asyncio.run(main())
