"""The scheduler's side of surviving a lost control plane part. A scheduler that died
mid-run, replaced by a restarted one (as Ray restarts its actor): the new one adopts
the workers, which forget the dead one's sequences, and requests resubmitted with the
tokens already received go on exactly as an undisturbed run. A client that stops
polling (a dead router replica) loses its requests, and their blocks return."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler.client_leases import ClientExpiredError
from scheduler.config import CellConfig, SchedulerConfig
from scheduler.global_scheduler import GlobalScheduler, NoWorkersError
from scheduler.protocol import SamplingParams
from tests.scheduler.test_global_scheduler import _finish, _prompt, _scheduler

PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)}
PROMPTS = {"greedy": _prompt(1, 40), "seeded": _prompt(2, 9)}


def test_a_restarted_scheduler_adopts_the_workers_and_resumed_requests_go_on_unchanged(
        tiny_factory):
    path = tiny_factory("llama").path

    async def main() -> None:
        gs, handles = _scheduler(path, ["prefill", "decode"], prefill_threshold=16)
        refs = [w.ref for w in gs.workers]
        await gs.start()
        for rid, params in PARAMS.items():
            await gs.submit(rid, PROMPTS[rid], params)
        expected = await _finish(gs, list(PARAMS))
        assert all(len(t) == 12 for t in expected.values())

        # The same requests again, until each has streamed a few tokens; then the
        # scheduler dies with both still running on the workers.
        received: dict[str, list[int]] = {rid: [] for rid in PARAMS}
        for rid, params in PARAMS.items():
            await gs.submit(rid, PROMPTS[rid], params, client="router")
        while min(len(t) for t in received.values()) < 3:
            for rid, (ups, done, _) in (await gs.get_client_updates("router", 5.0)).items():
                assert not done
                received[rid] += [t for u in ups for t in u.new_token_ids]
        await gs.shutdown()
        assert sum(len(h.worker.runner.seqs) for h in handles) == 2

        restarted = GlobalScheduler([], gs.config, recovering=True)
        assert (await restarted.stats()).recovering
        with pytest.raises(NoWorkersError, match="retry in a few seconds"):
            await restarted.submit("late", PROMPTS["greedy"], PARAMS["greedy"])
        await restarted.adopt(refs)
        assert not (await restarted.stats()).recovering
        for rid, params in PARAMS.items():
            await restarted.submit(rid, PROMPTS[rid], params, client="router",
                                   generated=received[rid])
        rest = await _finish(restarted, list(PARAMS))
        assert {rid: received[rid] + rest[rid] for rid in PARAMS} == expected
        stats = await restarted.stats()
        assert [w.num_used_blocks for w in stats.workers] == [0, 0]
        assert [h.worker.runner.seqs for h in handles] == [{}, {}]   # the dead one's too
        await restarted.shutdown()

    asyncio.run(main())


def test_a_scheduler_without_workers_must_be_recovering():
    config = CellConfig(SchedulerConfig(), 16, 512, [0])
    with pytest.raises(ValueError, match="needs at least one worker"):
        GlobalScheduler([], config)


def test_a_gone_clients_requests_are_aborted_and_it_learns_so_at_its_next_poll(
        tiny_factory):
    path = tiny_factory("llama").path
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main() -> None:
        gs, handles = _scheduler(path, ["mixed"], client_lease_s=0.2)
        await gs.start()
        for rid, client in [("dead-1", "dead"), ("dead-2", "dead"), ("live-1", "live")]:
            await gs.submit(rid, _prompt(len(rid), 20), params, client=client)
        async with handles[0].lock:   # the worker is frozen: nothing finishes meanwhile
            deadline = time.monotonic() + 60
            while {"dead-1", "dead-2"} & set(gs.requests):
                assert time.monotonic() < deadline
                await gs.get_client_updates("live", 0.05)   # "live" keeps polling
            assert "live-1" in gs.requests
        tokens: list[int] = []
        while "live-1" in gs.requests:
            for ups, _, error in (await gs.get_client_updates("live", 5.0)).values():
                assert error is None
                tokens += [t for u in ups for t in u.new_token_ids]
        assert len(tokens) == 8
        with pytest.raises(ClientExpiredError, match="resubmit"):
            await gs.get_client_updates("dead", 0.05)
        await gs.submit("dead-3", _prompt(3, 20), params, client="dead")   # back again
        tokens = []
        while "dead-3" in gs.requests:
            for ups, _, error in (await gs.get_client_updates("dead", 5.0)).values():
                assert error is None
                tokens += [t for u in ups for t in u.new_token_ids]
        assert len(tokens) == 8
        deadline = time.monotonic() + 60
        while (await gs.stats()).workers[0].num_used_blocks:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await gs.shutdown()

    asyncio.run(main())
