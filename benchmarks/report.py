"""The offline benchmark's targets and its Markdown report, from the results dict alone.

``benchmarks.offline`` writes that dict as JSON; everything here is a pure function of
it, so a recorded run can be re-rendered and the report is testable without a model.
A peer's entry is ``{"result": PeerResult fields}``, ``{"skipped": why}`` or
``{"error": what}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Entry = dict[str, Any]
# The engine configuration the peers are compared with (issue #3: prefix caching off).
ENGINE = "engine_no_prefix_cache"
GIB = 1 << 30


@dataclass
class Check:
    """One issue target: what was measured against what is required (None: not measured)."""

    name: str
    measured: float | None
    bound: float
    at_least: bool = True  # else the measurement must stay below the bound
    unit: str = "x"

    @property
    def passed(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.bound if self.at_least else self.measured < self.bound

    def row(self) -> str:
        fmt = _pct if self.unit == "%" else (lambda v: f"{v:.2f}x")
        measured = "not measured" if self.measured is None else fmt(self.measured)
        verdict = {True: "pass", False: "**FAIL**", None: "—"}[self.passed]
        return f"| {self.name} | {measured} | {'≥' if self.at_least else '<'} " \
               f"{fmt(self.bound)} | {verdict} |"


def tokens_per_s(entry: Entry | None) -> float | None:
    """Output tokens per second of a peer's run; None when it was skipped or failed."""
    if not entry or "result" not in entry:
        return None
    r = entry["result"]
    return r["output_tokens"] / r["elapsed_s"] if r["elapsed_s"] > 0 else None


def time_per_token(entry: Entry | None) -> float | None:
    """Seconds per output token (prefill included); None when not run."""
    tps = tokens_per_s(entry)
    return 1 / tps if tps else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def _extra(entry: Entry | None, key: str) -> Any:
    return entry["result"]["extra"].get(key) if entry and "result" in entry else None


def checks(results: dict[str, Any]) -> list[Check]:
    """Every issue #3 target, in the issue's order."""
    a, b = results.get("workload_a", {}), results.get("workload_b", {})
    engine_a = tokens_per_s(a.get(ENGINE))
    split = _extra(a.get(ENGINE), "split_at_64")
    sched_prep = (split["schedule_frac"] + split["prepare_frac"]
                  if split and split["steps"] else None)
    batch1 = results.get("batch1", {})
    memory = results.get("memory", {})
    return [
        Check("A: engine ÷ HF generate (static batches)", ratio(engine_a,
              tokens_per_s(a.get("hf_static"))), 3.0),
        Check("A: engine ÷ HF generate_batch", ratio(engine_a,
              tokens_per_s(a.get("hf_continuous"))), 5.0),
        Check("A: engine ÷ llama.cpp sequential", ratio(engine_a,
              tokens_per_s(a.get("llama_cpp"))), 2.5),
        Check("A: fraction of the linear-layer roofline",
              _extra(a.get(ENGINE), "roofline_fraction"), 0.60, unit="%"),
        Check("B: prefix caching on ÷ off", ratio(tokens_per_s(b.get("engine")),
              tokens_per_s(b.get(ENGINE))), 2.0),
        Check("batch 1: HF generate ÷ engine time per output token",
              ratio(batch1.get("hf_static_s"), batch1.get("engine_s")), 1.0),
        Check("scheduling + input preparation at 56–72 running", sched_prep, 0.05,
              at_least=False, unit="%"),
        Check("concurrent sequences ÷ contiguous model-dtype cache, same bytes (A max_model_len)",
              memory.get("vs_contiguous_workload"), 4.0),
        Check("KV slots holding live tokens at peak", memory.get("kv_utilisation_at_peak"),
              0.95, unit="%"),
    ]


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def peer_table(entries: dict[str, Entry], reference: str) -> list[str]:
    """One row per peer; the last column is ``reference``'s throughput over the peer's."""
    ref = tokens_per_s(entries.get(reference))
    lines = [f"| peer | requests | output tokens | elapsed s | output tok/s | req/s | "
             f"{reference} ÷ peer | peak RSS GiB |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for label, entry in entries.items():
        if "result" not in entry:
            why = entry.get("skipped") or f"failed: {entry.get('error', '').splitlines()[0]}"
            lines.append(f"| {label} | {why} | | | | | | |")
            continue
        r, tps = entry["result"], tokens_per_s(entry)
        lines.append(f"| {label} | {r['num_requests']} | {r['output_tokens']:,} | "
                     f"{r['elapsed_s']:.1f} | {_fmt(tps)} | "
                     f"{_fmt(r['num_requests'] / r['elapsed_s'], '.3f')} | "
                     f"{_fmt(ratio(ref, tps), '.2f')} | {r['peak_rss_bytes'] / GIB:.2f} |")
        notes.append(f"- {label}: {r['notes']}")
    return [*lines, "", *notes]


def split_table(entry: Entry | None) -> list[str]:
    """The engine's per-step time split, over all steps and at 56–72 running sequences."""
    every, band = _extra(entry, "split"), _extra(entry, "split_at_64")
    if not every:
        return ["(engine not run)"]
    phases = [k[:-2] for k in every if k.endswith("_s") and k != "step_s"]
    lines = [f"| phase | all {every['steps']} steps | {band['steps']} steps at 56–72 running |",
             "|---|---|---|"]
    for p in phases:
        at_64 = _pct(band[f"{p}_frac"]) if band["steps"] else "—"
        lines.append(f"| {p} | {_pct(every[f'{p}_frac'])} ({every[f'{p}_s']:.1f} s) | {at_64} |")
    return lines


def sweep_table(sweep: dict[str, dict[str, Entry]]) -> list[str]:
    """Output tok/s per peer (rows) and concurrency (columns); llama.cpp runs sequentially."""
    levels = sorted({int(c) for points in sweep.values() for c in points if c.isdigit()})
    lines = ["| peer | " + " | ".join(map(str, levels)) + " |", "|---" * (len(levels) + 1) + "|"]
    for label, points in sweep.items():
        if "sequential" in points:
            cells = [_fmt(tokens_per_s(points["sequential"]))] * len(levels)
        else:
            cells = [_fmt(tokens_per_s(points.get(str(c)))) for c in levels]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The report, ready to paste into ``benchmarks/RESULTS.md``."""
    meta, memory = results["meta"], results.get("memory", {})
    out = [f"## Offline throughput against peers (issue #3) — {meta['date']}", "",
           f"`{meta['command']}` — {meta['machine']}; default model, fp32 compute, greedy, "
           f"`ignore_eos` (every engine generates the same number of tokens).", ""]
    for key, title, reference in (("workload_a", "Workload A (chat-like)", ENGINE),
                                  ("workload_b", "Workload B (shared system prompt)", "engine")):
        if results.get(key):
            out += [f"### {title}: {meta[key]}", "", *peer_table(results[key], reference), ""]
    hit = _extra(results.get("workload_b", {}).get("engine"), "prefix_hit_rate")
    if hit is not None:
        out += [f"Workload B prefix-cache hit rate: {_pct(hit)} of prompt tokens.", ""]
    out += ["### Targets", "", "| target | measured | required | result |", "|---|---|---|---|",
            *(c.row() for c in checks(results)), ""]
    out += [f"### Per-step split ({ENGINE}, Workload A)", "",
            *split_table(results.get("workload_a", {}).get(ENGINE)), ""]
    if memory:
        out += ["### KV memory (Workload A)", "", *(f"- {line}" for line in memory["lines"]), ""]
    if results.get("sweep"):
        out += [f"### Output tok/s against concurrency ({meta['sweep']})", "",
                *sweep_table(results["sweep"]), "",
                "llama.cpp serves one request at a time: the same figure at every concurrency.",
                ""]
    return "\n".join(out)
