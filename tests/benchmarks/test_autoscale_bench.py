"""What the autoscale bench reads from each scrape of the router's /metrics."""

from __future__ import annotations

from benchmarks.autoscale import pool_state
from benchmarks.metric_samples import parse
from cluster import metrics
from scheduler.protocol import Role
from scheduler.stats import CellStats, PoolReport, StepTimes, WorkerReport, WorkerState


def test_pool_state_reads_workers_per_state_and_steps_per_worker():
    def worker(worker_id: str, role: Role, steps: int) -> WorkerReport:
        return WorkerReport(worker_id, role, WorkerState.SERVING, num_blocks=10,
                            num_free_blocks=10, num_used_blocks=0, num_running=0,
                            num_waiting=0, worker_num_seqs=0, prefix_hit_rate=0.0,
                            step_times=StepTimes(steps=steps))

    pools = [PoolReport(Role.PREFILL, target=1, serving=1, pending=0, draining=0,
                        min_workers=1, max_workers=1),
             PoolReport(Role.DECODE, target=3, serving=1, pending=2, draining=1,
                        min_workers=1, max_workers=3)]
    stats = CellStats([worker("prefill-0", Role.PREFILL, 12), worker("decode-0", Role.DECODE, 40)],
                      num_requests=0, num_waiting=0, num_handoffs=0, num_recovered=0,
                      pools=pools)
    workers, steps = pool_state(parse(metrics.render(stats, "m").decode()))
    assert {k: v for k, v in workers.items() if v} == {
        "prefill/serving": 1, "decode/serving": 1, "decode/pending": 2, "decode/draining": 1}
    assert steps == {"prefill-0": 12.0, "decode-0": 40.0}
