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
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

PREFIX = "llm_cluster"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WORKER_LABELS = ["role", "worker", "model_name"]


def render(stats: dict[str, Any], model_name: str) -> bytes:
    """Prometheus text of a ``GlobalScheduler.stats`` snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model_name))
    return generate_latest(registry)


class _Snapshot:
    """A one-shot collector over one stats snapshot."""

    def __init__(self, stats: dict[str, Any], model_name: str) -> None:
        self.stats = stats
        self.model = model_name

    def collect(self) -> Iterator[Metric]:
        yield from self._vllm()
        yield from self._workers()
        yield from self._tiers([w for w in self.stats["workers"] if w.get("tiers")])

    # ---- vLLM's names ----------------------------------------------------------------
    def _vllm(self) -> Iterator[Metric]:
        s, serving, m = self.stats, self.stats["serving"], [self.model]
        live = [w for w in s["workers"] if w["alive"]]
        everyone = s["workers"]   # counters keep a lost worker's share: they never decrease

        def gauge(name: str, help_text: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"vllm:{name}", help_text, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, help_text: str, value: float) -> Metric:
            c = CounterMetricFamily(f"vllm:{name}", help_text, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Requests in a worker's running batch.",
                    sum(w["num_running"] for w in live))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    s["num_waiting"])
        yield gauge("kv_cache_usage_perc", "KV-cache usage over the live workers' pools; "
                    "1 means 100 percent.", sum(w["num_used_blocks"] for w in live)
                    / max(sum(w["num_blocks"] for w in live), 1))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      sum(w["prefix_queried_tokens"] for w in everyone))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      sum(w["prefix_hit_tokens"] for w in everyone))
        yield counter("num_preemptions", "Sequences preempted (recomputed later) for room.",
                      sum(w["num_preemptions"] for w in everyone))
        yield counter("prompt_tokens", "Prefilled prompt tokens of requests.",
                      serving["prompt_tokens"])
        yield counter("generation_tokens", "Generated tokens.", serving["generation_tokens"])
        success = CounterMetricFamily("vllm:request_success", "Finished requests, by finish "
                                      "reason.", labels=["model_name", "finished_reason"])
        for reason, count in sorted(serving["finished"].items()):
            success.add_metric([self.model, reason], count)
        yield success
        for name, key, help_text in (
                ("time_to_first_token_seconds", "ttft",
                 "Submission to the scheduler to a request's first token."),
                ("inter_token_latency_seconds", "itl", "Gap between a request's tokens."),
                ("e2e_request_latency_seconds", "e2e",
                 "Submission to the scheduler to a request's end.")):
            yield _histogram(f"vllm:{name}", help_text, serving[key], m)

    # ---- ours: errors, per worker, KV transfer ---------------------------------------
    def _workers(self) -> Iterator[Metric]:
        errors = CounterMetricFamily(f"{PREFIX}_errors", "Requests refused or failed, by "
                                     "error kind.", labels=["kind", "model_name"])
        for kind, count in sorted(self.stats["serving"]["errors"].items()):
            errors.add_metric([kind, self.model], count)
        yield errors
        recovered = CounterMetricFamily(f"{PREFIX}_recovered_requests", "Requests "
                                        "recomputed after a worker loss.",
                                        labels=["model_name"])
        recovered.add_metric([self.model], self.stats["num_recovered"])
        yield recovered
        workers = self.stats["workers"]
        gauges: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
            ("num_requests_running", "Sequences running on a worker.",
             lambda w: w["num_running"]),
            ("num_requests_waiting", "Sequences queued for a worker.",
             lambda w: w["num_waiting"]),
            ("kv_cache_usage_ratio", "Fraction of a worker's KV blocks in use.",
             lambda w: w["num_used_blocks"] / max(w["num_blocks"], 1)),
            ("kv_cache_free_blocks", "Free KV blocks of a worker.",
             lambda w: w["num_free_blocks"]),
            ("prefix_cache_hit_rate", "Prompt tokens found in a worker's prefix cache.",
             lambda w: w["prefix_hit_rate"]),
            ("worker_alive", "1 while the worker actor is alive.", lambda w: int(w["alive"]))]
        counters: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
            ("kv_transfer_bytes", "KV bytes a worker received in handoffs.",
             lambda w: w["kv_received"]["bytes"]),
            ("kv_transfer_seconds", "Seconds of a worker's received handoffs, first token "
             "to acknowledgement.", lambda w: w["kv_received"]["seconds"]),
            ("kv_transfers", "KV handoffs a worker received.",
             lambda w: w["kv_received"]["count"]),
            ("kv_transfer_failures", "KV handoffs a worker sent that failed.",
             lambda w: w["kv_sent"]["failures"]),
            ("num_preemptions", "Sequences a worker's batch preempted.",
             lambda w: w["num_preemptions"])]
        yield from self._per_worker(workers, gauges, counters)

    def _tiers(self, workers: list[dict[str, Any]]) -> Iterator[Metric]:
        """The host KV tier and sparse retrieval, for workers with long contexts on."""
        if not workers:
            return

        def stat(name: str) -> Callable[[dict[str, Any]], float]:
            return lambda w: (w.get("tier_stats") or {}).get(name, 0)

        gauges: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
            ("host_kv_blocks", "Blocks of a worker's host KV tier.",
             lambda w: w["tiers"]["host_blocks"]),
            ("host_kv_usage_ratio", "Fraction of a worker's host KV blocks in use.",
             lambda w: w["tiers"]["host_used"] / max(w["tiers"]["host_blocks"], 1)),
            ("num_requests_sparse", "Sequences decoding with sparse attention, all KV on "
             "the device.", lambda w: w["tiers"]["sparse_seqs"]),
            ("num_requests_offloaded", "Sequences decoding with their middle KV blocks in "
             "the host tier.", lambda w: w["tiers"]["offloaded_seqs"])]
        counters: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
            ("kv_offloaded_blocks", "KV blocks a worker copied to its host tier.",
             stat("offloaded_blocks")),
            ("kv_host_received_blocks", "KV blocks handoffs wrote straight into a worker's "
             "host tier.", stat("received_blocks")),
            ("kv_recalled_blocks", "(layer, KV head) block slices a worker copied back from "
             "its host tier.", stat("recalled_blocks")),
            ("kv_recall_hits", "Selected (layer, KV head) block slices found in the recall "
             "cache.", stat("recall_hits"))]
        yield from self._per_worker(workers, gauges, counters)

    def _per_worker(self, workers: list[dict[str, Any]],
                    gauges: list[tuple[str, str, Callable[[dict[str, Any]], float]]],
                    counters: list[tuple[str, str, Callable[[dict[str, Any]], float]]]
                    ) -> Iterator[Metric]:
        for kind, specs in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, help_text, value in specs:
                family = kind(f"{PREFIX}_{name}", help_text, labels=_WORKER_LABELS)
                for w in workers:
                    family.add_metric([w["role"], w["worker_id"], self.model], value(w))
                yield family


def _histogram(name: str, help_text: str, h: dict[str, Any], labels: list[str]) -> Metric:
    """A ``serving_stats.Histogram`` snapshot (per-bucket counts) as Prometheus's
    cumulative buckets."""
    family = HistogramMetricFamily(name, help_text, labels=["model_name"])
    buckets, cumulative = [], 0
    for bound, count in zip([*map(str, h["buckets"]), "+Inf"], h["counts"]):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, sum_value=h["total"])
    return family
