"""The cluster on a real local Ray instance, against the one-process engine.

Tiny random checkpoints (no tokenizer: prompts are token ids) carry the arithmetic;
every comparison is greedy, so the cluster must produce the one-process engine's
tokens exactly, whatever the placement, handoffs, aborts or lost workers.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from cluster import LLM, SamplingParams
from cluster.cluster_engine import ClusterEngine
from cluster.config import config_from_dict
from scheduler.global_scheduler import NoWorkersError, OverloadedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LAYOUTS = {
    "1p1d": [{"role": "prefill", "resources": {"CPU": 0.5}},
             {"role": "decode", "resources": {"CPU": 0.5}}],
    "2p2d": [{"role": "prefill", "count": 2, "resources": {"CPU": 0.5}},
             {"role": "decode", "count": 2, "resources": {"CPU": 0.5}}],
    "mixed": [{"role": "mixed", "resources": {"CPU": 1}}],
}
_names = iter(range(10_000))


def _config(model: str, pools: list[dict] | None = None, kv_bytes: int = 2 << 20,
            scheduler: dict | None = None, **cluster: Any):
    data: dict[str, Any] = {"model": {"path": model}, "cache": {"kv_cache_bytes": kv_bytes},
                            "scheduler": scheduler or {}}
    if pools is not None:
        # Placement by length only, unless a test asks for it by load: handoff counts
        # must not depend on how fast the workers drain their queues.
        data["cluster"] = {"name": f"test-{next(_names)}", "pools": pools,
                           "prefill_threshold": 16, "max_prefill_queue_tokens": None,
                           **cluster}
    return config_from_dict(data)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths: short ones (prefilled on decode workers) and long, chunked ones."""
    rng = random.Random(seed)
    lengths = [3, 9, 17, 40, 70, 150, 33, 5, 64, 100, 12, 48]
    return [[rng.randrange(3, 256) for _ in range(lengths[i % len(lengths)] + i // 12)]
            for i in range(n)]


def _local(model: str, prompts: list[list[int]], sp: SamplingParams = GREEDY,
           **kw: Any) -> list[list[int]]:
    llm = LLM(config=_config(model, **kw))
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.fixture
def make_cluster(ray_instance):
    made: list[ClusterEngine] = []

    def make(model: str, layout: str | list[dict], **kw: Any) -> ClusterEngine:
        pools = LAYOUTS[layout] if isinstance(layout, str) else layout
        engine = ClusterEngine(_config(model, pools, **kw))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def _run(engine: ClusterEngine, prompts: list[list[int]], sp: SamplingParams = GREEDY,
         on_output=None) -> list[list[int]]:
    """Generate with streamed outputs; ``on_output(n_seen)`` runs after each output."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, None, p, sp, stream=True)
    done: dict[str, list[int]] = {}
    seen = 0
    while engine.has_unfinished():
        for out in engine.step():
            seen += 1
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
            if on_output is not None:
                on_output(seen)
    return [done[rid] for rid in ids]


def _wait_idle(engine: ClusterEngine, timeout_s: float = 60.0) -> dict[str, Any]:
    """Stats once every live worker holds no blocks and no sequences (drops are sent
    with the worker's next step, so this can lag the last output slightly)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        live = [w for w in stats.workers if w.alive]
        if all(w.num_used_blocks == 0 and w.worker_num_seqs == 0 for w in live) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _by_id(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {w.worker_id: w for w in stats.workers}


def _assert_pools_empty(stats: dict[str, Any]) -> None:
    for w in stats.workers:
        if w.alive:
            assert (w.worker_id, w.num_used_blocks, w.worker_num_seqs) == \
                (w.worker_id, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1p1d", "2p2d", "mixed"])
def test_greedy_outputs_equal_the_one_process_engine(tiny_factory, make_cluster, layout):
    model = tiny_factory("llama").path
    prompts = _prompts(24)
    expected = _local(model, prompts)
    engine = make_cluster(model, layout)
    assert _run(engine, prompts) == expected
    stats = _wait_idle(engine)
    _assert_pools_empty(stats)
    sent = sum(w.kv_sent.count for w in stats.workers)
    if layout == "mixed":
        assert sent == 0
    else:  # every long prompt was handed over, short ones were prefilled on decode workers
        assert sent == sum(1 for p in prompts if len(p) >= 16)
        assert all(w.kv_sent.failures == 0 for w in stats.workers)
        decode_steps = [w.num_steps for w in stats.workers if w.role == "decode"]
        assert all(n > 0 for n in decode_steps)
        received = sum(w.kv_received.bytes for w in stats.workers)
        assert received == sum(w.kv_sent.bytes for w in stats.workers) > 0
    for w in stats.workers:   # the figures metrics and autoscaling read
        assert w.alive and w.num_free_blocks == w.num_blocks > 0
        assert (w.num_running, w.num_waiting) == (0, 0)
        assert w.num_steps > 0 and w.mean_step_s >= w.mean_execute_s > 0
        assert 0.0 <= w.prefix_hit_rate <= 1.0


@pytest.mark.slow
def test_placement_by_prefill_backlog_keeps_the_greedy_text(tiny_factory, make_cluster):
    """With ``max_prefill_queue_tokens`` 0 every prompt goes where it costs least (queued
    prefill work, and the stall of the sequences a worker decodes), the decode worker
    included: whatever mix of local prefills and handoffs that gives, the tokens are the
    one-process engine's and both pools end empty."""
    model = tiny_factory("llama").path
    prompts = _prompts(24)
    engine = make_cluster(model, "1p1d", max_prefill_queue_tokens=0)
    assert _run(engine, prompts) == _local(model, prompts)
    stats = _wait_idle(engine)
    _assert_pools_empty(stats)
    assert sum(w.kv_sent.count for w in stats.workers) <= \
        sum(1 for p in prompts if len(p) >= 16)


def test_seeded_sampling_with_penalties_survives_the_handoff(tiny_factory, make_cluster):
    """Seeded draws depend on (seed, position) and penalties on the prompt/output split:
    both must carry over to the decode worker unchanged."""
    model = tiny_factory("llama").path
    prompts = _prompts(8, seed=9)
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, repetition_penalty=1.3,
                        frequency_penalty=0.5, max_tokens=20, ignore_eos=True)
    engine = make_cluster(model, "1p1d")
    assert _run(engine, prompts, sp) == _local(model, prompts, sp)


def test_llm_api_runs_on_the_cluster_config(tiny_factory, ray_instance):
    model = tiny_factory("llama").path
    prompts = _prompts(4, seed=3)
    llm = LLM(config=_config(model, LAYOUTS["1p1d"]))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _local(model, prompts)


@pytest.mark.slow
def test_decode_prefix_cache_receives_only_the_missing_blocks(tiny_factory, make_cluster):
    model = tiny_factory("llama").path
    rng = random.Random(7)
    first = [rng.randrange(3, 256) for _ in range(64)]          # 4 full blocks
    second = first[:48] + [rng.randrange(3, 256) for _ in range(22)]  # 3 shared, 5 in all
    engine = make_cluster(model, "1p1d")
    assert _run(engine, [first]) == _local(model, [first])
    sent_first = engine.stats().workers[0].kv_sent.bytes
    assert _run(engine, [second]) == _local(model, [second])
    stats = _wait_idle(engine)
    sent_second = stats.workers[0].kv_sent.bytes - sent_first
    # Only blocks 3 and 4 of 5 travel (4 did the first time); the KV payload dominates
    # the batch, the hash and count columns add a few bytes.
    assert sent_second / sent_first == pytest.approx(2 / 4, rel=0.01)
    decode = stats.workers[1]   # both prompts' tokens asked for, the 3 shared blocks hit
    assert (decode.prefix_queried_tokens, decode.prefix_hit_tokens) == (64 + 70, 48)
    _assert_pools_empty(stats)
    # The first prompt again: the decode side holds all of it, nothing travels.
    assert _run(engine, [first]) == _local(model, [first])
    stats = _wait_idle(engine)
    assert stats.workers[0].kv_sent.bytes == sent_first + sent_second
    _assert_pools_empty(stats)


@pytest.mark.slow
def test_aborts_at_any_point_free_blocks_in_both_pools(tiny_factory, make_cluster):
    model = tiny_factory("llama").path
    engine = make_cluster(model, "1p1d", scheduler={"max_num_batched_tokens": 32})
    sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompts = _prompts(12, seed=5)
    # Abort request i after its (i mod 4)-th streamed output: before the first token
    # (mid-prefill on the prefill worker), around the handoff, and mid-decode.
    ids = [f"a{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, None, p, sp, stream=True)
    seen = {rid: 0 for rid in ids}
    for i, rid in enumerate(ids):
        if i % 4 == 0:
            engine.abort_request(rid)
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id] += 1
            if seen[out.request_id] >= ids.index(out.request_id) % 4 + 1:
                engine.abort_request(out.request_id)
    stats = _wait_idle(engine)
    _assert_pools_empty(stats)
    assert stats.num_requests == 0


def test_overload_refuses_at_once_and_loses_nothing(tiny_factory, make_cluster):
    model = tiny_factory("llama").path
    engine = make_cluster(model, "mixed", scheduler={"max_num_seqs": 1}, max_waiting=2)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    long_run = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    prompts = _prompts(4, seed=11)
    engine.add_request("first", None, prompts[0], long_run, stream=True)
    while not engine.step():   # the first request runs, holding the only seat for long
        pass
    engine.add_request("second", None, prompts[1], sp, stream=True)
    engine.add_request("third", None, prompts[2], sp, stream=True)
    with pytest.raises(OverloadedError, match="overloaded: 2 requests are waiting"):
        engine.add_request("fourth", None, prompts[3], sp, stream=True)
    assert "fourth" not in engine.outputs.requests
    engine.abort_request("first")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[r] for r in ("second", "third")] == _local(model, prompts[1:3], sp)


@pytest.mark.slow
@pytest.mark.parametrize("layout,victim", [("2p2d", "decode-0"), ("2p2d", "prefill-0"),
                                           ("1p1d", "decode-0"), ("1p1d", "prefill-0")])
def test_killed_worker_is_recovered_without_repeats(tiny_factory, make_cluster, mid_run_kill,
                                                    layout, victim):
    """32 requests; one worker is killed mid-run. Every request finishes with the text of
    a run without the kill (streamed tokens are never repeated: the concatenated stream
    is compared), on the survivors of its role or, with none left, mixed on the others."""
    model = tiny_factory("llama").path
    prompts = _prompts(32, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _local(model, prompts, sp)
    engine = make_cluster(model, layout, scheduler={"max_num_batched_tokens": 64})
    kill = mid_run_kill(engine, victim)
    assert _run(engine, prompts, sp, on_output=kill) == expected
    assert kill.killed_at is not None
    stats = _wait_idle(engine)
    deadline = time.monotonic() + 60.0
    while _by_id(stats)[victim].alive and time.monotonic() < deadline:
        time.sleep(0.1)   # an idle worker's death is noticed at its next ping
        stats = engine.stats()
    assert not _by_id(stats)[victim].alive
    assert stats.num_recovered > 0
    _assert_pools_empty(stats)


def test_no_worker_left_is_a_clear_error(tiny_factory, make_cluster):
    import ray

    model = tiny_factory("llama").path
    engine = make_cluster(model, "mixed")
    sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request("r", None, _prompts(1)[0], sp, stream=True)
    while not engine.step():
        pass
    ray.kill(engine.workers["mixed-0"])
    with pytest.raises(NoWorkersError, match="no live worker|every worker"):
        while engine.has_unfinished():
            engine.step()


@pytest.mark.slow
def test_timed_out_transfers_are_abandoned_and_recomputed(tiny_factory, make_cluster):
    model = tiny_factory("llama").path
    prompts = [p for p in _prompts(12, seed=2) if len(p) >= 16]
    engine = make_cluster(model, "1p1d", transfer_timeout_s=1e-6)
    assert _run(engine, prompts) == _local(model, prompts)
    stats = _wait_idle(engine)
    prefill, decode = stats.workers
    assert prefill.alive and decode.alive
    assert prefill.kv_sent.failures == len(prompts)
    assert decode.kv_received.count == 0
    _assert_pools_empty(stats)


def test_generate_stream_yields_growing_outputs(tiny_factory, make_cluster):
    import asyncio

    model = tiny_factory("llama").path
    engine = make_cluster(model, "1p1d")
    prompt = _prompts(4)[3]

    async def collect() -> list[list[int]]:
        return [list(o.outputs[0].token_ids)
                async for o in engine.generate_stream(prompt, GREEDY)]

    seen = asyncio.run(collect())
    assert seen[-1] == _local(model, [prompt])[0]
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))
    assert len(seen) > 1


def test_a_long_poll_left_in_flight_by_a_closed_loop_loses_no_tokens(
        tiny_factory, make_cluster, monkeypatch):
    """The event loop ends while the client's shared long-poll waits (a batch job
    interrupted, then run again in the same process). The scheduler hands the next news
    to that poll; the next loop's streams must still get every token."""
    import asyncio

    import ray

    from cluster import cluster_client

    monkeypatch.setattr(cluster_client, "_POLL_S", 10.0)   # the poll outlives its loop
    model = tiny_factory("llama").path
    engine = make_cluster(model, "1p1d")
    prompts = _prompts(3)

    async def leave_a_poll_waiting() -> None:
        stream = await engine.open_stream(prompts[0], SamplingParams(temperature=0.0,
                                                                     max_tokens=200))
        outputs = stream.__aiter__()
        await outputs.__anext__()   # the pump runs; the stream stays open
        # No more news for this client: the pump's next poll waits when the loop ends.
        await engine.scheduler.abort.remote(stream.request_id)
        await asyncio.sleep(0.5)
        assert not ray.wait([engine._poll], timeout=0)[0]

    async def collect(prompt: list[int]) -> list[int]:
        *_, last = [o async for o in engine.generate_stream(prompt, GREEDY)]
        return list(last.outputs[0].token_ids)

    async def run_two() -> list[list[int]]:
        return list(await asyncio.gather(*(collect(p) for p in prompts[1:])))

    asyncio.run(leave_a_poll_waiting())
    assert asyncio.run(run_two()) == _local(model, prompts[1:])


def test_a_second_scheduler_of_the_same_name_is_refused_and_n_3_matches_offline(
        tiny_factory, make_cluster):
    model = tiny_factory("llama").path
    engine = make_cluster(model, "1p1d")
    config = _config(model, LAYOUTS["mixed"])
    config.cluster.name = engine.config.cluster.name
    with pytest.raises(ValueError, match="cluster.name: a scheduler named 'llm-scheduler-test"):
        ClusterEngine(config)
    assert engine.stats().num_requests == 0
    # n = 3 seeded: the same three choices as the one-process engine's forked ones.
    sp = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
    llm = LLM(config=_config(model))
    want = [[c.token_ids for c in o.outputs]
            for o in llm.generate([{"prompt_token_ids": p} for p in _prompts(4)], sp)]
    assert all(len({tuple(t) for t in choices}) == 3 for choices in want)
    for i, p in enumerate(_prompts(4)):
        engine.add_request(f"n{i}", None, p, sp)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, [c.token_ids for c in o.outputs]) for o in engine.step())
    assert [done[f"n{i}"] for i in range(4)] == want


def test_a_scheduler_left_behind_by_a_dead_driver_is_replaced(tiny_factory, ray_instance):
    """A killed driver takes its workers with it but not the detached scheduler; the
    next cluster of that name replaces the scheduler instead of refusing to start."""
    model = tiny_factory("llama").path
    config = _config(model, LAYOUTS["mixed"])
    stale = ClusterEngine(config)
    stale.pools.stop()   # the driver's pool thread dies with it
    for actor in stale.workers.values():
        ray_instance.kill(actor)
    engine = ClusterEngine(config)
    try:
        prompts = _prompts(3)
        assert _run(engine, prompts) == _local(model, prompts)
    finally:
        engine.shutdown()
