"""The scaling policy with synthetic signals and a synthetic clock; every expectation is
computed by hand from the limits below."""

from __future__ import annotations

import pytest

from cluster.autoscaler import PoolLoad, ScalingPolicy, pool_loads
from cluster.config import AutoscaleConfig, ConfigError, config_from_dict
from scheduler.protocol import Role
from scheduler.stats import CellStats, PoolReport, WorkerReport, WorkerState

CONFIG = AutoscaleConfig(queued_prefill_tokens=1000, ttft_target_s=1.0, kv_usage_high=0.8,
                         running_seqs_high=10, tpot_target_s=0.1, scale_down_fraction=0.5,
                         scale_down_delay_s=30.0, scale_up_cooldown_s=10.0)


def _decode(workers: int, running: int, kv: float = 0.1, tpot: float | None = 0.02,
            lo: int = 1, hi: int = 4) -> PoolLoad:
    return PoolLoad(Role.DECODE, workers, lo, hi, 0, running, kv, None, tpot)


def _prefill(workers: int, queued: int, ttft: float | None = 0.1) -> PoolLoad:
    return PoolLoad(Role.PREFILL, workers, 1, 4, queued, 0, 0.0, ttft, None)


def _one(policy: ScalingPolicy, now: float, load: PoolLoad) -> tuple[int, str] | None:
    out = policy.decide(now, [load])
    assert len(out) <= 1
    return (out[0].delta, out[0].reason) if out else None


def test_a_decode_pool_grows_on_each_signal_then_waits_for_its_cooldown():
    p = ScalingPolicy(CONFIG)
    assert _one(p, 0.0, _decode(1, 12)) == (1, "running_seqs/worker 12 > 10")
    assert _one(p, 5.0, _decode(2, 24)) is None          # 5 s < the 10 s cooldown
    assert _one(p, 10.0, _decode(2, 24)) == (1, "running_seqs/worker 12 > 10")
    assert _one(p, 30.0, _decode(4, 48)) is None         # at max_workers
    q = ScalingPolicy(CONFIG)
    assert _one(q, 0.0, _decode(2, 4, kv=0.9)) == (1, "kv_usage 0.9 > 0.8")
    r = ScalingPolicy(CONFIG)
    assert _one(r, 0.0, _decode(2, 4, tpot=0.15)) == (1, "tpot_s 0.15 > 0.1")


def test_a_prefill_pool_grows_on_queued_tokens_or_ttft():
    p = ScalingPolicy(CONFIG)
    # 2,500 tokens over 2 workers: 1,250 each > 1,000.
    assert _one(p, 0.0, _prefill(2, 2500)) == (1, "queued_prefill_tokens/worker 1.25e+03 > 1e+03")
    q = ScalingPolicy(CONFIG)
    assert _one(q, 0.0, _prefill(1, 0, ttft=1.5)) == (1, "ttft_s 1.5 > 1")
    # A mixed pool watches both roles' signals.
    mixed = PoolLoad(Role.MIXED, 1, 1, 2, 0, 11, 0.1, 0.1, 0.01)
    assert _one(ScalingPolicy(CONFIG), 0.0, mixed) == (1, "running_seqs/worker 11 > 10")


def test_it_shrinks_only_after_a_delay_of_load_that_one_worker_fewer_keeps_low():
    p = ScalingPolicy(CONFIG)
    # 3 workers, 12 running: 6 each on 2 workers >= 5 (half the limit): not low.
    assert _one(p, 0.0, _decode(3, 12)) is None
    # 8 running: 4 each on 2 workers < 5; KV 0.2 * 3/2 = 0.3 < 0.4; TPOT 0.02 < 0.05.
    assert _one(p, 100.0, _decode(3, 8, kv=0.2)) is None     # low from t=100
    assert _one(p, 129.0, _decode(3, 8, kv=0.2)) is None
    assert _one(p, 130.0, _decode(3, 8, kv=0.2)) == (
        -1, "low load for 30 s with 2 workers: kv_usage 0.3, running_seqs/worker 4, "
            "tpot_s 0.02")
    # Hysteresis: a mid-band reading (not over, not low) restarts the delay.
    assert _one(p, 200.0, _decode(2, 2)) is None             # low from t=200
    assert _one(p, 215.0, _decode(2, 8)) is None             # 8 on 1 worker >= 5
    assert _one(p, 220.0, _decode(2, 2)) is None             # low from t=220
    assert _one(p, 249.0, _decode(2, 2)) is None
    assert _one(p, 250.0, _decode(2, 2))[0] == -1
    assert _one(p, 400.0, _decode(1, 0)) is None             # at min_workers


def test_no_shrink_within_the_delay_of_a_growth_and_bounds_come_first():
    p = ScalingPolicy(CONFIG)
    assert _one(p, 0.0, _decode(1, 12))[0] == 1
    assert _one(p, 1.0, _decode(2, 0)) is None               # low from t=1
    assert _one(p, 29.0, _decode(2, 0)) is None              # 29 s after the growth
    assert _one(p, 31.0, _decode(2, 0))[0] == -1
    q = ScalingPolicy(CONFIG)
    assert _one(q, 0.0, _decode(1, 0, lo=2)) == (1, "1 workers < min_workers 2")
    assert _one(q, 0.5, _decode(1, 0, lo=2)) == (1, "1 workers < min_workers 2")
    assert _one(q, 1.0, _decode(5, 100, hi=4)) == (-1, "5 workers > max_workers 4")


def test_signals_come_from_serving_workers_of_the_pool():
    def worker(wid: str, role: Role, state: WorkerState, used: int, running: int,
               queued: int) -> WorkerReport:
        return WorkerReport(wid, role, state, 100, 100 - used, used, running, 0, running, 0.0,
                            queued_prefill_tokens=queued)

    stats = CellStats(
        [worker("d0", Role.DECODE, WorkerState.SERVING, 30, 6, 0),
         worker("d1", Role.DECODE, WorkerState.SERVING, 50, 9, 0),
         worker("d2", Role.DECODE, WorkerState.DRAINING, 90, 20, 0),
         worker("p0", Role.PREFILL, WorkerState.SERVING, 5, 0, 700)],
        num_requests=35, num_waiting=0, num_handoffs=0, num_recovered=0,
        ttft_s=0.5, tpot_s=0.05,
        pools=[PoolReport(Role.PREFILL, 1, 1, 0, 0, 1, 2),
               PoolReport(Role.DECODE, 3, 2, 1, 1, 1, 4)])
    prefill, decode = pool_loads(stats)
    assert prefill == PoolLoad(Role.PREFILL, 1, 1, 2, 700, 0, 0.05, 0.5, 0.05)
    assert decode == PoolLoad(Role.DECODE, 3, 1, 4, 0, 15, 0.4, 0.5, 0.05)


def test_pool_bounds_and_autoscale_settings_are_validated():
    with pytest.raises(ConfigError, match=r"cluster.pools\[0\].min_workers/count/max_workers: "
                                          r"got 2/1/4; expected 1 <= min_workers"):
        config_from_dict({"cluster": {"pools": [{"role": "decode", "min_workers": 2,
                                                 "max_workers": 4}]}})
    with pytest.raises(ConfigError, match="cluster.autoscale.kv_usage_high: got 1.5"):
        config_from_dict({"cluster": {"autoscale": {"kv_usage_high": 1.5}}})
    pool = config_from_dict({"cluster": {"pools": [{"role": "decode", "max_workers": 3}]}})
    assert pool.cluster.pools[0].bounds == (1, 3)
