"""The router's Prometheus metrics: request latencies it measures, errors it answers,
and the scheduler's per-worker figures, rendered as Prometheus text.

Latency histograms and error counters belong to one router replica (each replica
exposes its own, as a Prometheus scrape of every replica would sum them); the worker
gauges and KV transfer counters come from the global scheduler at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.stats import CellStats, WorkerReport

# Seconds: from a few ms (a short CPU step) to minutes (a long generation on a CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
PREFIX = "llm_cluster"


@dataclass
class Histogram:
    """Cumulative-bucket histogram, as Prometheus defines one."""

    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        name = f"{PREFIX}_{self.name}"
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}",
                  f"{name}_count {self.count}"]
        return lines


@dataclass
class RouterMetrics:
    """What one router replica has seen."""

    ttft: Histogram = field(default_factory=lambda: Histogram(
        "time_to_first_token_seconds", "Request arrival to its first generated token."))
    tpot: Histogram = field(default_factory=lambda: Histogram(
        "time_per_output_token_seconds", "Mean gap between a request's output tokens."))
    e2e: Histogram = field(default_factory=lambda: Histogram(
        "e2e_request_latency_seconds", "Request arrival to its last token."))
    errors: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)   # by finish reason
    in_flight: int = 0

    def observe_request(self, arrival: float, first_token: float | None, end: float,
                        num_tokens: int) -> None:
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((end - first_token) / (num_tokens - 1))
        self.e2e.observe(end - arrival)

    def render(self, stats: CellStats | None) -> str:
        """Prometheus text of this replica's figures and, if given, the scheduler's."""
        lines: list[str] = []
        _counter(lines, "requests_total", "Requests answered, by finish reason.",
                 [({"finish_reason": k}, v) for k, v in sorted(self.requests.items())])
        _counter(lines, "errors_total", "Requests refused or failed, by error kind.",
                 [({"kind": k}, v) for k, v in sorted(self.errors.items())])
        _gauge(lines, "router_requests_in_flight", "Requests this router replica is serving.",
               [({}, self.in_flight)])
        for h in (self.ttft, self.tpot, self.e2e):
            lines += h.render()
        if stats is not None:
            lines += _scheduler_lines(stats)
        return "\n".join(lines) + "\n"


def _scheduler_lines(stats: CellStats) -> list[str]:
    lines: list[str] = []
    workers = stats.workers

    def per_worker(key: Callable[[WorkerReport], float]
                   ) -> list[tuple[dict[str, str], float]]:
        return [({"worker": w.worker_id, "role": str(w.role)}, key(w)) for w in workers]

    _gauge(lines, "num_requests_running", "Sequences running on a worker.",
           per_worker(lambda w: w.num_running))
    _gauge(lines, "num_requests_waiting", "Sequences queued for a worker.",
           per_worker(lambda w: w.num_waiting))
    _gauge(lines, "kv_cache_usage_ratio", "Fraction of a worker's KV blocks in use.",
           per_worker(lambda w: w.kv_usage))
    _gauge(lines, "kv_cache_free_blocks", "Free KV blocks of a worker.",
           per_worker(lambda w: w.num_free_blocks))
    _gauge(lines, "prefix_cache_hit_rate", "Prompt blocks found in a worker's prefix cache.",
           per_worker(lambda w: w.prefix_hit_rate))
    _gauge(lines, "worker_alive", "1 while the worker actor is alive.",
           per_worker(lambda w: int(w.alive)))
    _counter(lines, "worker_steps_total", "Steps a worker has run.",
             per_worker(lambda w: w.num_steps))
    _counter(lines, "kv_transfer_bytes_total", "KV bytes a worker received in handoffs.",
             per_worker(lambda w: w.kv_received.bytes))
    _counter(lines, "kv_transfer_seconds_total",
             "Seconds of a worker's received handoffs, first token to acknowledgement.",
             per_worker(lambda w: w.kv_received.seconds))
    _counter(lines, "kv_transfers_total", "KV handoffs a worker received.",
             per_worker(lambda w: w.kv_received.count))
    _counter(lines, "kv_transfer_failures_total", "KV handoffs a worker sent that failed.",
             per_worker(lambda w: w.kv_sent.failures))
    _counter(lines, "recovered_requests_total", "Requests recomputed after a worker loss.",
             [({}, stats.num_recovered)])
    _counter(lines, "migrated_requests_total", "Running sequences moved off a draining "
             "worker by KV handoff.", [({}, stats.num_migrated)])
    _tier_lines(lines, [w for w in workers if w.tiers is not None])
    _pool_lines(lines, stats)
    return lines


def _pool_lines(lines: list[str], stats: CellStats) -> None:
    """Pool sizes and the autoscaler's decisions, with the cell's recent latencies
    that drive them."""
    _gauge(lines, "recent_ttft_seconds", "Mean time to first token, last 10 s, cell-wide.",
           [({}, stats.ttft_s)] if stats.ttft_s is not None else [])
    _gauge(lines, "recent_tpot_seconds", "Mean time per output token, last 10 s, cell-wide.",
           [({}, stats.tpot_s)] if stats.tpot_s is not None else [])
    if not stats.pools:
        return
    _gauge(lines, "pool_workers", "Workers of a pool, by state.",
           [({"role": str(p.role), "state": state}, getattr(p, state))
            for p in stats.pools for state in ("serving", "pending", "draining")])
    _gauge(lines, "pool_target_workers", "Workers a pool should have.",
           [({"role": str(p.role)}, p.target) for p in stats.pools])
    _counter(lines, "autoscale_decisions_total", "Scaling decisions, by pool and direction.",
             [({"role": str(p.role), "direction": d}, n) for p in stats.pools
              for d, n in (("up", p.scale_ups), ("down", p.scale_downs))])


def _tier_lines(lines: list[str], workers: list[WorkerReport]) -> None:
    """The host KV tier and sparse retrieval, for workers with long contexts on."""
    if not workers:
        return

    def per_worker(key: Callable[[WorkerReport], float]
                   ) -> list[tuple[dict[str, str], float]]:
        return [({"worker": w.worker_id, "role": str(w.role)}, key(w)) for w in workers]

    def worker_stat(name: str) -> Callable[[WorkerReport], float]:
        return lambda w: getattr(w.tier_stats, name) if w.tier_stats else 0

    _gauge(lines, "host_kv_blocks", "Blocks of a worker's host KV tier.",
           per_worker(lambda w: w.tiers.host_blocks))
    _gauge(lines, "host_kv_usage_ratio", "Fraction of a worker's host KV blocks in use.",
           per_worker(lambda w: w.tiers.host_used / max(w.tiers.host_blocks, 1)))
    _gauge(lines, "num_requests_sparse", "Sequences decoding with sparse attention, all KV "
           "on the device.", per_worker(lambda w: w.tiers.sparse_seqs))
    _gauge(lines, "num_requests_offloaded", "Sequences decoding with their middle KV "
           "blocks in the host tier.", per_worker(lambda w: w.tiers.offloaded_seqs))
    _counter(lines, "kv_offloaded_blocks_total", "KV blocks a worker copied to its host tier.",
             per_worker(worker_stat("offloaded_blocks")))
    _counter(lines, "kv_host_received_blocks_total", "KV blocks handoffs wrote straight "
             "into a worker's host tier.", per_worker(worker_stat("received_blocks")))
    _counter(lines, "kv_recalled_blocks_total", "(layer, KV head) block slices a worker "
             "copied back from its host tier.", per_worker(worker_stat("recalled_blocks")))
    _counter(lines, "kv_recall_hits_total", "Selected (layer, KV head) block slices found "
             "in the recall cache.", per_worker(worker_stat("recall_hits")))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _series(kind: str, lines: list[str], name: str, help_text: str,
            values: list[tuple[dict[str, str], float]]) -> None:
    full = f"{PREFIX}_{name}"
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{_labels(labels)} {value}" for labels, value in values]


def _gauge(lines: list[str], name: str, help_text: str,
           values: list[tuple[dict[str, str], float]]) -> None:
    _series("gauge", lines, name, help_text, values)


def _counter(lines: list[str], name: str, help_text: str,
             values: list[tuple[dict[str, str], float]]) -> None:
    _series("counter", lines, name, help_text, values)
