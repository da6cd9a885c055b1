"""Request-level serving figures of one cell, kept where every request passes: the
global scheduler.

Router replicas come and go and each sees only its share of the requests; the
scheduler sees them all, so counters kept here never jump backwards between two
scrapes that land on different replicas, and they sum to what was sent. Plain data:
``cluster.metrics`` turns a snapshot into Prometheus metric families (vLLM's names).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds, vLLM's buckets: from a few ms (a short CPU step) to minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Per-bucket counts (not cumulative) over ``buckets`` upper bounds, the last bucket
    being +Inf; with the sum and count of the observations."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class RequestTimes:
    """One request's clock (monotonic seconds), for its latency observations."""

    arrival: float
    last_token: float | None = None


@dataclass
class ServingStats:
    """Totals since the scheduler started: tokens, requests by finish reason, refusals by
    kind, and the latency histograms (time to first token, inter-token latency,
    end-to-end), measured from submission to the scheduler."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)   # finish reason -> requests
    errors: dict[str, int] = field(default_factory=dict)     # kind -> refused requests
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def tokens(self, times: RequestTimes, num_prompt_tokens: int, num_new: int,
               now: float) -> None:
        """New tokens of a request: its first gives the time to first token (and counts
        its prompt), later ones the inter-token latency, their step's gap shared out."""
        if not num_new:
            return
        self.generation_tokens += num_new
        if times.last_token is None:
            self.prompt_tokens += num_prompt_tokens
            self.ttft.observe(now - times.arrival)
        else:
            gap = (now - times.last_token) / num_new
            for _ in range(num_new):
                self.itl.observe(gap)
        times.last_token = now

    def finish(self, times: RequestTimes, reason: str, now: float) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(now - times.arrival)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
