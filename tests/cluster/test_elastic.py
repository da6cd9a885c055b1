"""Workers joining, leaving and dying on a running cell, on a real local Ray instance.

Greedy texts are compared with the one-process engine's: a sequence that moved (by KV
handoff, or recomputed after a loss) must go on exactly where it was, so its streamed
text is neither repeated nor cut.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster import SamplingParams
from cluster.cluster_engine import ClusterEngine
from scheduler.protocol import Role
from scheduler.stats import WorkerState
from tests.cluster.test_ray_cluster import (
    LAYOUTS,
    _assert_pools_empty,
    _config,
    _local,
    _prompts,
    _run,
    _wait_idle,
)

LONG = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
_JOIN_S = 300.0   # a worker loading on a shared machine


@pytest.fixture
def one_one(ray_instance):
    """``one_one(model, **cluster)``: a running cell of one prefill and one decode worker
    of half a CPU each; shut down after the test."""
    made: list[ClusterEngine] = []

    def make(model: str, **kw) -> ClusterEngine:
        made.append(ClusterEngine(_config(model, LAYOUTS["1p1d"], **kw)))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def _pid(engine, worker_id: str) -> int:
    import ray

    actor = engine.workers[worker_id]
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


@pytest.mark.slow
def test_a_decode_worker_added_under_load_takes_sequences(tiny_factory, one_one):
    model = tiny_factory("llama").path
    first, second = _prompts(16, seed=3), _prompts(16, seed=4)
    expected = _local(model, first + second, LONG)
    engine = one_one(model)
    added: list[str] = []

    def add_then_load(seen: int) -> None:
        if added:
            return
        added.append(engine.pools.add(Role.DECODE))
        engine.pools.wait_joined(added[0], _JOIN_S)
        for i, p in enumerate(second):   # prompts arriving once it serves
            engine.add_request(f"s{i}", None, p, LONG, stream=True)

    done: dict[str, list[int]] = {}
    for i, p in enumerate(first):
        engine.add_request(f"f{i}", None, p, LONG, stream=True)
    seen = 0
    while engine.has_unfinished():
        for out in engine.step():
            seen += 1
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
            add_then_load(seen)
    ids = [f"f{i}" for i in range(16)] + [f"s{i}" for i in range(16)]
    assert [done[r] for r in ids] == expected
    stats = _wait_idle(engine)
    new = stats.worker(added[0])
    assert new.state is WorkerState.SERVING and new.kv_received.count > 0
    _assert_pools_empty(stats)


@pytest.mark.slow
def test_a_removed_decode_worker_migrates_its_16_running_sequences(tiny_factory, one_one):
    """decode-0 holds 16 decoding sequences, frozen (SIGSTOP) while decode-1 loads so
    none finishes meanwhile; removing it moves all 16 to decode-1 by KV handoff."""
    model = tiny_factory("llama").path
    prompts = [p for p in _prompts(24, seed=5) if len(p) >= 16][:16]
    assert len(prompts) == 16
    expected = _local(model, prompts, LONG)
    engine = one_one(model, kv_bytes=4 << 20)
    state: dict[str, int] = {}

    def remove_when_all_decode(seen: int) -> None:
        if state:
            return
        decode = engine.stats().worker("decode-0")
        if decode.num_running < 16:
            return
        pid = _pid(engine, "decode-0")
        os.kill(pid, signal.SIGSTOP)
        try:
            state["peer"] = engine.pools.add(Role.DECODE)
            engine.pools.wait_joined(state["peer"], _JOIN_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        engine.pools.remove("decode-0")
        state["removed_at"] = seen

    assert _run(engine, prompts, LONG, on_output=remove_when_all_decode) == expected
    assert state, "decode-0 never held the 16 sequences at once"
    engine.pools.wait_gone("decode-0", 60.0)
    stats = _wait_idle(engine)
    assert "decode-0" not in {w.worker_id for w in stats.workers}
    assert (stats.num_migrated, stats.num_recovered) == (16, 0)
    peer = stats.worker(state["peer"])
    assert peer.kv_received.count >= 16 and peer.kv_received.failures == 0
    _assert_pools_empty(stats)


@pytest.mark.slow
def test_a_killed_worker_is_replaced_after_its_requests_finish_elsewhere(
        tiny_factory, one_one):
    model = tiny_factory("llama").path
    prompts = _prompts(24, seed=6)
    expected = _local(model, prompts, LONG)
    engine = one_one(model, replace_backoff_s=0.5)
    killed: list[int] = []

    def kill(seen: int) -> None:
        if not killed and engine.stats().worker("decode-0").num_running > 0:
            killed.append(seen)
            os.kill(_pid(engine, "decode-0"), signal.SIGKILL)

    assert _run(engine, prompts, LONG, on_output=kill) == expected
    assert killed
    engine.pools.wait_joined("decode-1", _JOIN_S)   # the replacement
    deadline = time.monotonic() + 60.0
    stats = engine.stats()
    while stats.worker("decode-0").alive and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = engine.stats()
    assert stats.worker("decode-0").state is WorkerState.LOST
    assert stats.worker("decode-1").state is WorkerState.SERVING
    assert stats.num_recovered > 0
    assert [(p.role, p.serving, p.pending) for p in engine.pools.status()] == \
        [(Role.PREFILL, 1, 0), (Role.DECODE, 1, 0)]
    # The replacement serves: a short prompt decodes there from its first token.
    assert _run(engine, [[5, 6, 7]], LONG) == _local(model, [[5, 6, 7]], LONG)
    assert engine.stats().worker("decode-1").num_steps > 0


@pytest.mark.slow
def test_the_decode_pool_grows_under_a_load_ramp_and_shrinks_after_it(tiny_factory,
                                                                      ray_instance):
    """A bounded ramp: 16 requests (cycling over 64 prompts) kept in flight until the
    decode pool has grown to its maximum and the new worker serves (at most 300 s),
    then none. Only the running-sequences signal is in play (latency targets out of
    reach). Every request ends with the one-process engine's text, the pool shrinks
    back after the delay, and every block is free."""
    model = tiny_factory("llama").path
    pools = [{"role": "prefill", "resources": {"CPU": 0.5}},
             {"role": "decode", "resources": {"CPU": 0.5}, "min_workers": 1,
              "max_workers": 2}]
    autoscale = {"interval_s": 0.2, "running_seqs_high": 4, "ttft_target_s": 1e6,
                 "tpot_target_s": 1e6, "scale_up_cooldown_s": 1.0, "scale_down_delay_s": 2.0}
    engine = ClusterEngine(_config(model, pools, autoscale=autoscale))
    try:
        prompts = _prompts(64, seed=7)
        done: dict[str, list[int]] = {}
        submitted = 0
        grown = False
        ramp_end = time.monotonic() + 300.0
        while engine.has_unfinished() or (not grown and time.monotonic() < ramp_end):
            grown = grown or engine.pools.status()[1].serving == 2
            while not grown and time.monotonic() < ramp_end and \
                    submitted - len(done) < 16:
                engine.add_request(f"r{submitted}", None, prompts[submitted % 64], LONG)
                submitted += 1
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert grown, "the decode pool never grew"
        deadline = time.monotonic() + 120.0
        while engine.pools.status()[1].serving + engine.pools.status()[1].draining > 1:
            assert time.monotonic() < deadline, engine.pools.status()
            time.sleep(0.2)
        expected = _local(model, prompts, LONG)
        assert [done[f"r{i}"] for i in range(submitted)] == \
            [expected[i % 64] for i in range(submitted)]
        moves = [d.delta for _, d in engine.autoscaler.decisions if d.role is Role.DECODE]
        assert moves == [1, -1]
        stats = _wait_idle(engine)
        report = engine.pools.status()[1]
        assert (report.target, report.serving, report.scale_ups, report.scale_downs) == \
            (1, 1, 1, 1)
        assert "running_seqs/worker" in engine.autoscaler.decisions[0][1].reason
        _assert_pools_empty(stats)
    finally:
        engine.shutdown()
