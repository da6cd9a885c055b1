"""Autoscaling under a load ramp (issue 16), against a static pool sized for the peak.

Both runs serve the default model with ``python -m cluster serve`` on 127.0.0.1 and see
the same trace: N streaming chat clients, N stepping through ``--levels`` (1 -> 32 -> 1
by default), each level held ``--step-s`` seconds; a client sends requests one after
another while its level lasts. The autoscaled run has one prefill worker and a decode
pool of ``--min-decode`` to ``--max-decode`` workers; the static run has
``--max-decode`` decode workers throughout. Every second the bench reads the router's
/metrics: workers per pool and state, and each worker's steps (when a new worker ran
its first step). Reported per run: p50/p99 TTFT and TPOT, failed requests, SLO
attainment (TTFT <= --ttft-slo-s and TPOT <= --tpot-slo-s), worker-seconds (workers
held, pending and draining included, integrated over the run) and, for the autoscaled
run, the time from each load rise to the first step of the worker it brought.

``--migration`` instead measures a drain: 16 running sequences of the default model
moved off a decode worker by KV handoff (time and bytes), against recomputing the
same 16 sequences (prompt plus tokens so far) on the peer. With ``--long`` they are
1,400-token windows of real English text decoding in offload mode (long-context
regions scaled down to the model's window, as ``chaos_long_context.yaml`` has them), so
each moves with its middle read from the worker's host tier.

    python -m cluster bench autoscale [--levels 1 2 4 8 16 32 16 8 4 2 1] [--step-s 15]
        [--max-tokens 32] [--plot PATH] [--json] | --migration [--long]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks import metric_samples
from benchmarks.http_load import (
    HOST,
    free_port,
    make_prompts,
    project_spec,
    running_server,
    stream_chat,
)
from benchmarks.load_stats import RequestResult, percentile


@dataclass
class Sample:
    """The cell at one moment of a run (seconds from its start)."""

    t: float
    clients: int
    workers: dict[str, int]   # "role/state" -> count
    steps: dict[str, float]   # worker id -> steps run


@dataclass
class RunResult:
    name: str
    requests: list[RequestResult] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rises: list[float] = field(default_factory=list)   # when the client count went up


def cell_config(name: str, decode: tuple[int, int, int], args: argparse.Namespace) -> dict:
    """1 prefill worker and a decode pool of (min, count, max) workers."""
    low, count, high = decode
    return {"cache": {"kv_cache_bytes": 256 << 20},
            "cluster": {"name": name, "replace_backoff_s": 1.0,
                        "pools": [{"role": "prefill", "resources": {"CPU": args.cpus}},
                                  {"role": "decode", "count": count, "min_workers": low,
                                   "max_workers": high, "resources": {"CPU": args.cpus}}],
                        "autoscale": {"interval_s": 1.0, "running_seqs_high": args.seqs_high,
                                      "tpot_target_s": args.tpot_slo_s,
                                      "ttft_target_s": args.ttft_slo_s,
                                      "scale_up_cooldown_s": args.step_s,
                                      "scale_down_delay_s": args.scale_down_delay_s
                                      or args.step_s}}}


def pool_state(samples: metric_samples.Samples) -> tuple[dict[str, int], dict[str, float]]:
    """Workers per ``role/state`` and steps per worker, from a scrape of the router's
    /metrics."""
    workers: dict[str, int] = {}
    steps: dict[str, float] = {}
    for (name, labels), value in samples.items():
        label = dict(labels)
        if name == "llm_cluster_pool_workers":
            workers[f"{label['role']}/{label['state']}"] = int(value)
        elif name == "llm_cluster_worker_steps_total":
            steps[label["worker"]] = value
    return workers, steps


async def drive(base: str, model: str, levels: Sequence[int], step_s: float,
                max_tokens: int, result: RunResult) -> None:
    """The trace: client i runs while the current level exceeds i."""
    prompts = make_prompts(4096, seed=1)
    start = time.perf_counter()
    end = start + step_s * len(levels)

    def level(now: float) -> int:
        return levels[min(int((now - start) / step_s), len(levels) - 1)]

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        k = 0
        while (now := time.perf_counter()) < end:
            if level(now) <= i:
                await asyncio.sleep(0.1)
                continue
            prompt = prompts[(i * 97 + k) % len(prompts)]
            k += 1
            result.requests.append(await stream_chat(session, base, model, prompt,
                                                     max_tokens, now + 600))

    async def sampler() -> None:
        last = 0
        while (now := time.perf_counter()) < end + 4 * step_s:
            workers, steps = pool_state(
                await asyncio.to_thread(metric_samples.scrape, base, None, 30.0))
            n = level(now) if now < end else 0
            if n > last:
                result.rises.append(now - start)
            last = n
            result.samples.append(Sample(now - start, n, workers, steps))
            await asyncio.sleep(1.0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(sampler(), *(client(i, session) for i in range(max(levels))))


def run(name: str, config: dict, args: argparse.Namespace) -> RunResult:
    result = RunResult(name)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    try:
        with running_server(project_spec(free_port(), f.name), 600) as (base, model):
            warm = RunResult("warm-up")
            asyncio.run(drive(base, model, [1], 5.0, args.max_tokens, warm))
            asyncio.run(drive(base, model, args.levels, args.step_s, args.max_tokens, result))
    finally:
        Path(f.name).unlink()
    return result


def summary(r: RunResult, args: argparse.Namespace) -> dict[str, Any]:
    done = [q for q in r.requests if q.finished]
    ttft = [q.ttft for q in done]
    tpot = [q.tpot for q in done if q.tpot is not None]
    slo = [q for q in done if q.ttft <= args.ttft_slo_s and (q.tpot or 0) <= args.tpot_slo_s]
    held = 0.0
    for a, b in zip(r.samples, r.samples[1:]):
        held += sum(a.workers.values()) * (b.t - a.t)
    out = {"run": r.name, "requests": len(r.requests), "failed": len(r.requests) - len(done),
           "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
           "slo_attainment": len(slo) / len(r.requests) if r.requests else None,
           "worker_seconds": held, "rise_to_first_step_s": rise_to_first_step(r),
           "max_decode_workers": max((s.workers.get("decode/serving", 0) for s in r.samples),
                                     default=0)}
    return out


def rise_to_first_step(r: RunResult) -> list[float]:
    """For each worker that joined during the run: from the last load rise before it was
    launched (it first counted as pending) to its first step."""
    if not r.samples:
        return []
    known = set(r.samples[0].steps)
    pending_since: float | None = None
    out = []
    for s in r.samples:
        if s.workers.get("decode/pending", 0) and pending_since is None:
            pending_since = s.t
        for wid, steps in s.steps.items():
            if wid not in known and steps > 0:
                known.add(wid)
                rises = [t for t in r.rises if t <= (pending_since or s.t)]
                if rises:
                    out.append(s.t - rises[-1])
                pending_since = None
    return out


def plot(runs: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r, style in zip(runs, ("-", "--")):
        t = [s.t for s in r.samples]
        axes[0].plot(t, [s.workers.get("decode/serving", 0) + s.workers.get("decode/pending", 0)
                         for s in r.samples], style, label=f"{r.name}: decode workers")
        axes[0].plot(t, [s.workers.get("prefill/serving", 0) for s in r.samples], style,
                     label=f"{r.name}: prefill workers")
        done = sorted((q.sent - r.requests[0].sent, q.ttft) for q in r.requests if q.finished)
        axes[1].plot([a for a, _ in done], [b for _, b in done], style, marker=".",
                     linewidth=0.5, label=f"{r.name}: TTFT")
    ax2 = axes[0].twinx()
    ax2.plot([s.t for s in runs[0].samples], [s.clients for s in runs[0].samples], ":",
             color="grey", label="clients")
    ax2.set_ylabel("streaming clients")
    axes[0].set_ylabel("workers")
    axes[0].legend(loc="upper left", fontsize=7)
    axes[1].set_ylabel("TTFT (s)")
    axes[1].set_xlabel("seconds")
    axes[1].legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, list):
            return ", ".join(f"{x:.1f}" for x in v) or "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(f(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _long_prompts(tok: Any, count: int, length: int = 1400) -> list[list[int]]:
    """``count`` windows of ``length`` tokens of the recall benchmark's real text."""
    from benchmarks.long_context_recall import read_text

    ids = tok.encode(read_text(None)[0])
    stride = (len(ids) - length) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


def migration(args: argparse.Namespace) -> dict[str, Any]:
    """16 running sequences moved off a draining decode worker, against recomputing them."""
    from cluster.cluster_engine import ClusterEngine
    from cluster.config import config_from_dict
    from scheduler.protocol import Role, SamplingParams

    # Fixed pools, so no autoscaler acts (it had drained decode-0 of a long run while it
    # waited for its prompts); the peer is added by hand.
    config = cell_config("bench-migrate", (1, 1, 1), args)
    config["cache"]["enable_prefix_caching"] = False   # a recompute must not hit a cache
    if args.long:
        config["cache"]["kv_cache_bytes"] = 512 << 20
        config["long_context"] = {"enabled": True, "initial_tokens": 64,
                                  "local_tokens": 256, "retrieval_block_size": 32,
                                  "top_k_percent": 0.2, "dense_boundary": 512,
                                  "offload_boundary": 1024, "host_kv_bytes": 1 << 30}
    engine = ClusterEngine(config_from_dict(config))
    try:
        tok = engine.tokenizer
        prompts = (_long_prompts(tok, 16) if args.long
                   else [tok.encode(p) for p in make_prompts(16, seed=2)])
        sp = SamplingParams(temperature=0.0, max_tokens=1024 if args.long else 256,
                            ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"m{i}", None, p, sp, stream=True)

        def add_peer() -> str:
            peer = engine.pools.add(Role.DECODE)
            engine.pools.wait_joined(peer, 600)
            return peer

        # Short prompts are all prefilled before a new worker has loaded, so it joins
        # first; long ones take longer, so it joins once decode-0 holds all 16.
        peer = None if args.long else add_peer()
        while engine.stats().worker("decode-0").num_running < 16:
            engine.step()
        peer = peer or add_peer()
        tiers = engine.stats().worker("decode-0").tiers
        # Each sequence's tokens so far (a long-poll returns all news since the last),
        # taken just before the drain: what it moves, give or take a step.
        seen: dict[str, list[int]] = {}
        while len(seen) < 16:
            seen.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step())
        before = engine.stats().worker(peer).kv_received
        start = time.perf_counter()
        engine.pools.remove("decode-0")
        while engine.stats().num_migrated < 16:
            engine.step()
        moved_s = time.perf_counter() - start
        after = engine.stats().worker(peer).kv_received
        while engine.has_unfinished():
            engine.step()
        # Recompute: the same sequences, as far as they had streamed when the drain began
        # (a step or two short of what moved), prefilled on the peer.
        again = [p + seen.get(f"m{i}", []) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        for i, p in enumerate(again):
            engine.add_request(f"c{i}", None, p, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        recompute_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {"sequences": 16, "offloaded": tiers.offloaded_seqs if tiers else 0,
            "migrate_s": moved_s, "migrate_bytes": after.bytes - before.bytes,
            "handoff_s_sum": after.seconds - before.seconds,
            "transports": {k: n - before.transports.get(k, 0)
                           for k, n in after.transports.items()},
            "recompute_tokens": sum(map(len, again)),
            "recompute_s": recompute_s, "recompute_over_migrate": recompute_s / moved_s}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 16, 8, 4, 2, 1])
    p.add_argument("--step-s", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=3)
    p.add_argument("--cpus", type=float, default=0.5, help="CPU share of each worker")
    p.add_argument("--seqs-high", type=int, default=8,
                   help="running sequences per decode worker above which the pool grows")
    p.add_argument("--scale-down-delay-s", type=float, default=None,
                   help="low load held this long before the pool shrinks (default: one "
                        "level of the trace)")
    p.add_argument("--ttft-slo-s", type=float, default=10.0)
    p.add_argument("--tpot-slo-s", type=float, default=1.0)
    p.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    p.add_argument("--migration", action="store_true",
                   help="measure the 16-sequence migration against recompute instead")
    p.add_argument("--long", action="store_true",
                   help="with --migration: sequences in offload mode")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    print(f"autoscale bench, {time.strftime('%Y-%m-%d')}, {HOST}")
    if args.migration:
        m = migration(args)
        print(table([m]))
        if args.json:
            print(json.dumps(m))
        return 0
    lo, hi = args.min_decode, args.max_decode
    auto = run("autoscaled", cell_config("bench-auto", (lo, lo, hi), args), args)
    static = run("static", cell_config("bench-static", (hi, hi, hi), args), args)
    rows = [summary(auto, args), summary(static, args)]
    print(table(rows))
    if rows[1]["worker_seconds"]:
        print(f"worker-seconds autoscaled / static: "
              f"{rows[0]['worker_seconds'] / rows[1]['worker_seconds']:.2f}")
    if args.plot:
        plot([auto, static], args.plot)
    if args.json:
        print(json.dumps({"runs": rows, "samples": {r.name: [asdict(s) for s in r.samples]
                                                     for r in (auto, static)}}))
    return 0
