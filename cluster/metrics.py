"""``/metrics``: the cell's figures as Prometheus metric families, built with
``prometheus_client`` from one snapshot of the global scheduler's stats.

Request-level series carry vLLM's names (``vllm:prompt_tokens_total``,
``vllm:time_to_first_token_seconds``, ...) so vLLM's dashboards and autoscalers read
them as they are; per-worker, KV-transfer and long-context series keep our
``llm_cluster_`` prefix. Every series is labelled with ``model_name``. All of them come
from the scheduler, which sees every request whichever router replica took it, so
any replica answers the same totals and a counter never goes backwards between two
scrapes that land on different replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from scheduler.serving_stats import Histogram
from scheduler.stats import CellStats, WorkerReport

PREFIX = "llm_cluster"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WORKER_LABELS = ["role", "worker", "model_name"]


def render(stats: CellStats, model_name: str) -> bytes:
    """Prometheus text of a ``GlobalScheduler.stats`` snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model_name))
    return generate_latest(registry)


WorkerValue = Callable[[WorkerReport], float]
_Specs = list[tuple[str, str, WorkerValue]]


class _Snapshot:
    """A one-shot collector over one stats snapshot."""

    def __init__(self, stats: CellStats, model_name: str) -> None:
        self.stats = stats
        self.model = model_name

    def collect(self) -> Iterator[Metric]:
        yield from self._vllm()
        yield from self._workers()
        yield from self._tiers([w for w in self.stats.workers if w.tiers is not None])
        yield from self._pools()

    # ---- vLLM's names ----------------------------------------------------------------
    def _vllm(self) -> Iterator[Metric]:
        s, serving, m = self.stats, self.stats.serving, [self.model]
        live = s.live()
        everyone = s.workers   # counters keep a lost worker's share: they never decrease

        def gauge(name: str, help_text: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"vllm:{name}", help_text, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, help_text: str, value: float) -> Metric:
            c = CounterMetricFamily(f"vllm:{name}", help_text, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Requests in a worker's running batch.",
                    sum(w.num_running for w in live))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage over the live workers' pools; "
                    "1 means 100 percent.", sum(w.num_used_blocks for w in live)
                    / max(sum(w.num_blocks for w in live), 1))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      sum(w.prefix_queried_tokens for w in everyone))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      sum(w.prefix_hit_tokens for w in everyone))
        yield counter("num_preemptions", "Sequences preempted (recomputed later) for room.",
                      sum(w.num_preemptions for w in everyone))
        yield counter("prompt_tokens", "Prefilled prompt tokens of requests.",
                      serving.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", serving.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Finished requests, by finish "
                                      "reason.", labels=["model_name", "finished_reason"])
        for reason, count in sorted(serving.finished.items()):
            success.add_metric([self.model, reason], count)
        yield success
        for name, h, help_text in (
                ("time_to_first_token_seconds", serving.ttft,
                 "Submission to the scheduler to a request's first token."),
                ("inter_token_latency_seconds", serving.itl, "Gap between a request's tokens."),
                ("e2e_request_latency_seconds", serving.e2e,
                 "Submission to the scheduler to a request's end.")):
            yield _histogram(f"vllm:{name}", help_text, h, m)

    # ---- ours: errors, per worker, KV transfer ---------------------------------------
    def _workers(self) -> Iterator[Metric]:
        errors = CounterMetricFamily(f"{PREFIX}_errors", "Requests refused or failed, by "
                                     "error kind.", labels=["kind", "model_name"])
        for kind, count in sorted(self.stats.serving.errors.items()):
            errors.add_metric([kind, self.model], count)
        yield errors
        yield self._cell_counter("recovered_requests", "Requests recomputed after a worker "
                                 "loss or a failed handoff.", self.stats.num_recovered)
        yield self._cell_counter("migrated_requests", "Running sequences moved off a "
                                 "draining worker by KV handoff.", self.stats.num_migrated)
        workers = self.stats.workers
        gauges: _Specs = [
            ("num_requests_running", "Sequences running on a worker.",
             lambda w: w.num_running),
            ("num_requests_waiting", "Sequences queued for a worker.",
             lambda w: w.num_waiting),
            ("kv_cache_usage_ratio", "Fraction of a worker's KV blocks in use.",
             lambda w: w.kv_usage),
            ("kv_cache_free_blocks", "Free KV blocks of a worker.",
             lambda w: w.num_free_blocks),
            ("prefix_cache_hit_rate", "Prompt tokens found in a worker's prefix cache.",
             lambda w: w.prefix_hit_rate),
            ("worker_alive", "1 while the worker actor is alive.", lambda w: int(w.alive))]
        counters: _Specs = [
            ("worker_steps", "Steps a worker has run.", lambda w: w.num_steps),
            ("kv_transfer_bytes", "KV bytes a worker received in handoffs.",
             lambda w: w.kv_received.bytes),
            ("kv_transfer_seconds", "Seconds of a worker's received handoffs, first token "
             "to acknowledgement.", lambda w: w.kv_received.seconds),
            ("kv_transfers", "KV handoffs a worker received.",
             lambda w: w.kv_received.count),
            ("kv_transfer_failures", "KV handoffs a worker sent that failed.",
             lambda w: w.kv_sent.failures),
            ("kv_pushes", "Pushes of a prefilling prompt's finished blocks a worker "
             "received ahead of the handoff.", lambda w: w.kv_received.pushes),
            ("kv_pushed_bytes", "KV bytes a worker received in pushes ahead of handoffs.",
             lambda w: w.kv_received.pushed_bytes),
            ("num_preemptions", "Sequences a worker's batch preempted.",
             lambda w: w.num_preemptions),
            ("recomputed_tokens", "Tokens a worker computed again after their sequence "
             "was preempted (prefix-cache hits not included).",
             lambda w: w.num_recomputed_tokens)]
        yield from self._per_worker(workers, gauges, counters)
        by_transport = CounterMetricFamily(
            f"{PREFIX}_kv_transfers_by_transport", "KV handoffs a worker received, by "
            "transport.", labels=[*_WORKER_LABELS, "transport"])
        for w in workers:
            for transport, count in sorted(w.kv_received.transports.items()):
                by_transport.add_metric([str(w.role), w.worker_id, self.model, transport],
                                        count)
        yield by_transport

    def _tiers(self, workers: list[WorkerReport]) -> Iterator[Metric]:
        """The host KV tier and sparse retrieval, for workers with long contexts on."""
        if not workers:
            return

        def stat(name: str) -> WorkerValue:
            return lambda w: getattr(w.tier_stats, name) if w.tier_stats else 0

        gauges: _Specs = [
            ("host_kv_blocks", "Blocks of a worker's host KV tier.",
             lambda w: w.tiers.host_blocks),
            ("host_kv_usage_ratio", "Fraction of a worker's host KV blocks in use.",
             lambda w: w.tiers.host_used / max(w.tiers.host_blocks, 1)),
            ("num_requests_sparse", "Sequences decoding with sparse attention, all KV on "
             "the device.", lambda w: w.tiers.sparse_seqs),
            ("num_requests_offloaded", "Sequences decoding with their middle KV blocks in "
             "the host tier.", lambda w: w.tiers.offloaded_seqs)]
        counters: _Specs = [
            ("kv_offloaded_blocks", "KV blocks a worker copied to its host tier.",
             stat("offloaded_blocks")),
            ("kv_host_received_blocks", "KV blocks handoffs wrote straight into a worker's "
             "host tier.", stat("received_blocks")),
            ("kv_recalled_blocks", "(layer, KV head) block slices a worker copied back from "
             "its host tier.", stat("recalled_blocks")),
            ("kv_recall_hits", "Selected (layer, KV head) block slices found in the recall "
             "cache.", stat("recall_hits"))]
        yield from self._per_worker(workers, gauges, counters)

    # ---- pools and the autoscaler ----------------------------------------------------
    def _pools(self) -> Iterator[Metric]:
        """Pool sizes and the autoscaler's decisions, with the cell's recent latencies
        that drive them."""
        s, m = self.stats, [self.model]
        for name, value, help_text in (
                ("recent_ttft_seconds", s.ttft_s,
                 "Mean time to first token, last 10 s, cell-wide."),
                ("recent_tpot_seconds", s.tpot_s,
                 "Mean time per output token, last 10 s, cell-wide.")):
            g = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=["model_name"])
            if value is not None:
                g.add_metric(m, value)
            yield g
        if not s.pools:
            return
        workers = GaugeMetricFamily(f"{PREFIX}_pool_workers", "Workers of a pool, by state.",
                                    labels=["role", "state", "model_name"])
        target = GaugeMetricFamily(f"{PREFIX}_pool_target_workers", "Workers a pool should "
                                   "have.", labels=["role", "model_name"])
        decisions = CounterMetricFamily(f"{PREFIX}_autoscale_decisions", "Scaling decisions, "
                                        "by pool and direction.",
                                        labels=["role", "direction", "model_name"])
        for p in s.pools:
            role = str(p.role)
            for state in ("serving", "pending", "draining"):
                workers.add_metric([role, state, self.model], getattr(p, state))
            target.add_metric([role, self.model], p.target)
            decisions.add_metric([role, "up", self.model], p.scale_ups)
            decisions.add_metric([role, "down", self.model], p.scale_downs)
        yield from (workers, target, decisions)

    def _cell_counter(self, name: str, help_text: str, value: float) -> Metric:
        c = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=["model_name"])
        c.add_metric([self.model], value)
        return c

    def _per_worker(self, workers: list[WorkerReport], gauges: _Specs,
                    counters: _Specs) -> Iterator[Metric]:
        for kind, specs in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, help_text, value in specs:
                family = kind(f"{PREFIX}_{name}", help_text, labels=_WORKER_LABELS)
                for w in workers:
                    family.add_metric([str(w.role), w.worker_id, self.model], value(w))
                yield family


def _histogram(name: str, help_text: str, h: Histogram, labels: list[str]) -> Metric:
    """A ``serving_stats.Histogram`` (per-bucket counts) as Prometheus's cumulative
    buckets."""
    family = HistogramMetricFamily(name, help_text, labels=["model_name"])
    buckets, cumulative = [], 0
    for bound, count in zip([*map(str, h.buckets), "+Inf"], h.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, sum_value=h.total)
    return family
