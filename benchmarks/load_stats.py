"""The HTTP load benchmarks' pure parts: one streamed request as a client sees it, the
figures of a load level, and the report comparing the project with its peer.

``http_load`` and ``autoscale`` drive the servers; this module only reads what they
received, so its tests need no server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROJECT, PEER = "cluster", "transformers"
# The target, checked at this client count.
TARGET_CLIENTS, TARGET_THROUGHPUT_RATIO = 32, 3.0

DONE = "[DONE]"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of an SSE stream: the JSON of a ``data:`` line, ``DONE`` for
    ``data: [DONE]``, None for anything else (blank separators, comments, other fields)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    return DONE if payload == DONE else json.loads(payload)


@dataclass
class RequestResult:
    """One request as the client saw it; times are ``time.perf_counter`` seconds."""

    sent: float
    first: float | None = None  # first chunk with content
    last: float | None = None  # last chunk with content
    end: float | None = None  # the stream closed
    content_chunks: int = 0
    usage_tokens: int | None = None  # completion_tokens of the usage chunk, when sent
    error: str = ""

    def observe(self, event: dict[str, Any], now: float) -> None:
        """Account one streamed chunk received at ``now``."""
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
            self.content_chunks += 1
            self.first = now if self.first is None else self.first
            self.last = now
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])

    @property
    def finished(self) -> bool:
        return not self.error and self.end is not None and self.first is not None

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count when it sent usage, else one per content chunk."""
        return self.content_chunks if self.usage_tokens is None else self.usage_tokens

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks
    (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelStats:
    """One server at one client count; latencies in seconds, None when nothing finished.
    ``output_tokens`` counts every token received in the level, cut-off requests' too, so
    a time bound does not discard the work of requests in flight."""

    clients: int
    sent: int
    finished: int
    output_tokens: int
    mean_output_tokens: float  # per finished request
    wall_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    e2e_p50: float | None
    errors: list[str] = field(default_factory=list)  # distinct error messages

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.finished / self.wall_s if self.wall_s > 0 else 0.0


def summarize(clients: int, results: Sequence[RequestResult], wall_s: float) -> LevelStats:
    """Figures of one level: latencies over its finished requests, throughput over its
    wall time."""
    done = [r for r in results if r.finished]
    ttfts = [r.ttft for r in done]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    e2es = [r.end - r.sent for r in done if r.end is not None]
    finished_tokens = sum(r.tokens for r in done)
    return LevelStats(clients=clients, sent=len(results), finished=len(done),
                      output_tokens=sum(r.tokens for r in results),
                      mean_output_tokens=finished_tokens / len(done) if done else 0.0,
                      wall_s=wall_s, ttft_p50=percentile(ttfts, 50),
                      ttft_p99=percentile(ttfts, 99), tpot_p50=percentile(tpots, 50),
                      tpot_p99=percentile(tpots, 99), e2e_p50=percentile(e2es, 50),
                      errors=sorted({r.error for r in results if r.error}))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


@dataclass
class Comparison:
    """Project over peer at one client count (None where either side has no figure)."""

    clients: int
    throughput: float | None  # output tokens/s
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None


def compare(project: LevelStats, peer: LevelStats) -> Comparison:
    latencies = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
    return Comparison(project.clients, ratio(project.tokens_per_s, peer.tokens_per_s),
                      *(ratio(getattr(project, k), getattr(peer, k)) for k in latencies))


def target_met(c: Comparison) -> bool | None:
    """The issue's target: at least 3x the peer's throughput with a lower p99 TPOT."""
    if c.throughput is None or c.tpot_p99 is None:
        return None
    return c.throughput >= TARGET_THROUGHPUT_RATIO and c.tpot_p99 < 1.0


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{1e3 * seconds:.0f}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def report(runs: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per server and client count, then project/peer ratios and the
    target. ``runs[name]`` is ``{"levels": [LevelStats]}`` or ``{"error": why}``."""
    lines = ["| server | clients | finished/sent | output tok/s | req/s | mean out tokens "
             "| TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        for s in run.get("levels", ()):
            lines.append(f"| {name} | {s.clients} | {s.finished}/{s.sent} | "
                         f"{s.tokens_per_s:.1f} | {s.requests_per_s:.2f} | "
                         f"{s.mean_output_tokens:.1f} | {_ms(s.ttft_p50)} | {_ms(s.ttft_p99)} | "
                         f"{_ms(s.tpot_p50)} | {_ms(s.tpot_p99)} |")
    errors = [f"- {name} did not run: {run['error']}" for name, run in runs.items()
              if "error" in run]
    errors += [f"- {name}, {s.clients} clients: {e}" for name, run in runs.items()
               for s in run.get("levels", ()) for e in s.errors]
    if errors:
        lines += ["", "Errors:", *errors]
    comparisons = comparisons_of(runs)
    if comparisons:
        lines += ["", f"{PROJECT} / {PEER} (throughput above 1 and latencies below 1 favour "
                  f"{PROJECT}):", "",
                  "| clients | throughput | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c.clients} | {_x(c.throughput)} | {_x(c.ttft_p50)} | {_x(c.ttft_p99)} | "
                  f"{_x(c.tpot_p50)} | {_x(c.tpot_p99)} |" for c in comparisons]
        at_target = [c for c in comparisons if c.clients == TARGET_CLIENTS]
        if at_target:
            c = at_target[0]
            verdict = {True: "met", False: "**not met**", None: "not measured"}[target_met(c)]
            lines += ["", f"Target at {TARGET_CLIENTS} clients (≥ {TARGET_THROUGHPUT_RATIO:g}x "
                      f"throughput, lower p99 TPOT): throughput {_x(c.throughput)}x, p99 TPOT "
                      f"ratio {_x(c.tpot_p99)}: {verdict}."]
    return "\n".join(lines)


def comparisons_of(runs: dict[str, dict[str, Any]]) -> list[Comparison]:
    """Ratios at every client count both servers measured."""
    if "levels" not in runs.get(PROJECT, {}) or "levels" not in runs.get(PEER, {}):
        return []
    peer = {s.clients: s for s in runs[PEER]["levels"]}
    return [compare(s, peer[s.clients]) for s in runs[PROJECT]["levels"] if s.clients in peer]
