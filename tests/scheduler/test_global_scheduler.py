"""The global scheduler in one process: its workers are in-process ``Worker``s behind a
stand-in for Ray actor handles, so placement and handoff run deterministically.

Calls to one stand-in actor run in submission order, one at a time, as Ray runs a
synchronous actor's calls; a killed one fails every call with ``RayActorError``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import torch
from ray.exceptions import RayActorError

from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.global_scheduler import GlobalScheduler, OverloadedError, WorkerRef
from scheduler.protocol import SamplingParams
from workers.worker import Worker, WorkerSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class _Method:
    def __init__(self, actor: _Actor, name: str, num_returns: int = 1) -> None:
        self.actor, self.name, self.num_returns = actor, name, num_returns

    def options(self, num_returns: int = 1) -> _Method:
        return _Method(self.actor, self.name, num_returns)

    def remote(self, *args: Any) -> Any:
        task = asyncio.get_running_loop().create_task(self.actor.call(self.name, args))
        if self.num_returns == 1:
            return task
        return [_Item(task, i) for i in range(self.num_returns)]


class _Item:
    def __init__(self, task: asyncio.Task, index: int) -> None:
        self.task, self.index = task, index

    def __await__(self):
        return (yield from _pick(self.task, self.index).__await__())


async def _pick(task: asyncio.Task, index: int) -> Any:
    return (await task)[index]


class _Actor:
    """A Worker behind ``.method.remote(...)`` calls, run in order like a Ray actor."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.dead = False
        self.lock = asyncio.Lock()

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    async def call(self, name: str, args: tuple) -> Any:
        async with self.lock:
            resolved = [await a if inspect.isawaitable(a) else a for a in args]
            if self.dead:
                raise RayActorError()
            return getattr(self.worker, name)(*resolved)


def _scheduler(path: str, roles: list[str], kv_dtypes: dict[int, str] | None = None,
               node_ids: dict[int, str] | None = None,
               **kw: Any) -> tuple[GlobalScheduler, list[_Actor]]:
    actors, refs = [], []
    for i, role in enumerate(roles):
        cache = CacheConfig(kv_cache_bytes=1 << 20, kv_dtype=(kv_dtypes or {}).get(i, "auto"))
        worker = Worker(WorkerSpec(path, None, "float32", "cpu", 0, "torch", cache, None, 1),
                        role, (node_ids or {}).get(i, "node-a"))
        actors.append(_Actor(worker))
        info = worker.info()
        refs.append(WorkerRef(f"{role}-{i}", role, actors[-1], info.num_blocks, 0, info.place))
    info = actors[0].worker.info()
    gs = GlobalScheduler(refs, SchedulerConfig(), 16, True, 512, info.eos_token_ids, **kw)
    return gs, actors


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
        assert [gs.requests[r].worker.ref.worker_id for r in "ab"] == ["prefill-0",
                                                                      "prefill-1"]
        await _finish(gs, ["a", "b"])
        await gs.submit("b2", b[:40] + [5, 6, 7, 8], GREEDY)   # b's blocks sit on prefill-1
        await gs.submit("short", [9, 10, 11], GREEDY)          # under the threshold
        assert gs.requests["b2"].worker.ref.worker_id == "prefill-1"
        assert gs.requests["short"].worker.ref.worker_id == "decode-2"
        await _finish(gs, ["b2", "short"])
        stats = await gs.stats()
        assert stats["workers"][1]["prefix_hit_rate"] > 0
        await gs.shutdown()

    asyncio.run(main())


def test_refused_batch_is_recomputed_on_the_decode_side(tiny_factory):
    """A decode pool with another KV dtype refuses every batch; each sequence is then
    recomputed there and ends with the text a matching pool gives."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 20 + 9 * i) for i in range(4)}

    async def run(kv_dtypes: dict[int, str]) -> tuple[dict[str, list[int]], dict]:
        gs, _ = _scheduler(path, ["prefill", "decode"], kv_dtypes)
        await gs.start()
        for rid, p in prompts.items():
            await gs.submit(rid, p, GREEDY)
        out = await _finish(gs, list(prompts))
        stats = await gs.stats()
        await gs.shutdown()
        return out, stats

    async def main() -> None:
        good, good_stats = await run({})
        assert good_stats["workers"][0]["kv_sent"]["count"] == len(prompts)
        refused, stats = await run({1: "float16"})
        assert stats["workers"][0]["kv_sent"]["failures"] == len(prompts)
        assert stats["num_recovered"] == len(prompts)
        assert all(w["num_used_blocks"] == 0 for w in stats["workers"])
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

    async def run(roles: list[str], node_ids: dict[int, str]) -> tuple[dict, dict]:
        gs, _ = _scheduler(path, roles, node_ids=node_ids)
        await gs.start()
        for rid, p in prompts.items():
            await gs.submit(rid, p, GREEDY)
        out = await _finish(gs, list(prompts))
        stats = await gs.stats()
        await gs.shutdown()
        return out, stats

    async def main() -> None:
        alone, _ = await run(["mixed"], {})
        for node_ids, transport in (({}, "shm"), ({1: "node-b"}, "object_store")):
            out, stats = await run(["prefill", "decode"], node_ids)
            sent, received = stats["workers"][0]["kv_sent"], stats["workers"][1]["kv_received"]
            assert sent["transports"] == received["transports"] == {transport: len(prompts)}
            assert sent["failures"] == 0 and out == alone

    asyncio.run(main())


def test_a_block_corrupted_in_the_senders_pool_after_export_is_recomputed(tiny_factory):
    """A byte flipped in the prefill worker's shared pool between its export and the
    decode worker's copy fails that block's checksum: each handoff is refused and its
    sequence recomputed on the decode side, ending with the tokens of a clean run."""
    path = tiny_factory("llama").path
    prompts = {f"r{i}": _prompt(i, 20 + 9 * i) for i in range(3)}

    async def run(corrupt: bool) -> tuple[dict, dict]:
        gs, actors = _scheduler(path, ["prefill", "decode"])
        sender = actors[0].worker
        export = sender.export_kv

        def export_then_corrupt(block_ids, *args):
            out = export(block_ids, *args)
            if corrupt:
                sender.runner.kv_caches[-1][1, block_ids[-1]].view(torch.uint8).view(-1)[7] ^= 1
            return out

        sender.export_kv = export_then_corrupt
        await gs.start()
        for rid, p in prompts.items():
            await gs.submit(rid, p, GREEDY)
        out = await _finish(gs, list(prompts))
        stats = await gs.stats()
        await gs.shutdown()
        return out, stats

    async def main() -> None:
        clean, clean_stats = await run(False)
        assert clean_stats["workers"][0]["kv_sent"]["transports"] == {"shm": len(prompts)}
        out, stats = await run(True)
        assert stats["workers"][0]["kv_sent"]["failures"] == len(prompts)
        assert stats["num_recovered"] == len(prompts)
        assert all(w["num_used_blocks"] == 0 for w in stats["workers"])
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
        assert [w["alive"] for w in stats["workers"]] == [False, True]
        assert stats["num_recovered"] == 1 and stats["workers"][1]["num_used_blocks"] == 0
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
        placed = [gs.requests[r].worker.ref.worker_id[0] for r in prompts]
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
