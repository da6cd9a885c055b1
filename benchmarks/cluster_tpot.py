"""Mixed load: p99 time per output token of 1 prefill + 1 decode worker vs one mixed worker.

Both layouts get the same cores (one CPU each for prefill and decode, or two for the
mixed worker, torch threads following the share) and the default model. Workload:
``--decoders`` requests with short prompts start at once and generate
``--decode-tokens`` tokens each; meanwhile ``--long`` requests with long prompts arrive
every ``--gap-s`` seconds (short outputs). On a mixed worker a long prefill shares the
steps of the decoding sequences and stalls them; disaggregated, the prefill runs on its
own worker and the decode worker only pays for the KV import.

Per request, TPOT = (time of last token - time of first token) / (tokens - 1), timed
where the client receives the streamed tokens. Reported: p50 and p99 over the
decoding requests, and the p99 and largest gaps between consecutive tokens.

    python benchmarks/cluster_tpot.py [--decoders 8] [--long 6] [--long-tokens 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import numpy as np
import ray

from cluster.cluster_engine import ClusterEngine
from cluster.config import config_from_dict
from scheduler.protocol import SamplingParams

LAYOUTS = {
    "1p1d": [{"role": "prefill", "resources": {"CPU": 1}},
             {"role": "decode", "resources": {"CPU": 1}}],
    "mixed": [{"role": "mixed", "resources": {"CPU": 2}}],
}


async def timed_stream(engine: ClusterEngine, prompt: list[int], sp: SamplingParams,
                       delay_s: float) -> list[float]:
    """Arrival times of each streamed token of one request submitted after ``delay_s``."""
    await asyncio.sleep(delay_s)
    times: list[float] = []
    seen = 0
    async for out in engine.generate_stream(prompt, sp):
        n = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        times.extend([now] * (n - seen))
        seen = n
    return times


async def workload(engine: ClusterEngine, args: argparse.Namespace,
                   seed: int) -> list[list[float]]:
    """One run; each seed draws other prompts, so no run hits another's prefix cache."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 10_000) for _ in range(n)]

    decode_sp = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    long_sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tasks = [timed_stream(engine, prompt(args.short_tokens), decode_sp, 0.0)
             for _ in range(args.decoders)]
    tasks += [timed_stream(engine, prompt(args.long_tokens), long_sp, 1.0 + i * args.gap_s)
              for i in range(args.long)]
    results = await asyncio.gather(*tasks)
    return results[:args.decoders]


def measure(layout: str, args: argparse.Namespace) -> dict[str, float]:
    engine = ClusterEngine(config_from_dict({
        "cache": {"kv_cache_bytes": 512 << 20},
        "cluster": {"name": f"bench-tpot-{layout}", "prefill_threshold": 64,
                    "pools": LAYOUTS[layout]}}))
    try:
        asyncio.run(workload(engine, args, seed=1))   # warm-up: first-call costs
        before = [w.kv_sent for w in engine.stats().workers]
        start = time.perf_counter()
        decoders = asyncio.run(workload(engine, args, seed=2))
        elapsed = time.perf_counter() - start
        sent = [{k: v - getattr(b, k) for k, v in vars(w.kv_sent).items()}
                for w, b in zip(engine.stats().workers, before)]
    finally:
        engine.shutdown()
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in decoders]
    gaps = np.concatenate([np.diff(t) for t in decoders])
    return {"tpot_p50_ms": 1e3 * statistics.median(tpots),
            "tpot_p99_ms": 1e3 * float(np.percentile(tpots, 99)),
            "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
            "gap_max_ms": 1e3 * float(gaps.max()),
            "elapsed_s": elapsed,
            "handoffs": sum(t["count"] for t in sent),
            "handoff_MB": sum(t["bytes"] for t in sent) / 1e6,
            "handoff_s": sum(t["seconds"] for t in sent),
            "handoff_export_s": sum(t["export_seconds"] for t in sent),
            "handoff_failures": sum(t["failures"] for t in sent)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--gap-s", type=float, default=1.0)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = {layout: measure(layout, args) for layout in LAYOUTS}
    finally:
        ray.shutdown()
    print(f"{args.decoders} decoding requests ({args.short_tokens}-token prompts, "
          f"{args.decode_tokens} tokens) while {args.long} {args.long_tokens}-token prompts "
          f"arrive every {args.gap_s} s; {time.strftime('%Y-%m-%d')}\n")
    print("| layout | TPOT p50 ms | TPOT p99 ms | token gap p99 ms | token gap max ms "
          "| elapsed s |")
    print("|---|---|---|---|---|---|")
    for layout, r in rows.items():
        print(f"| {layout} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} "
              f"| {r['gap_p99_ms']:.1f} | {r['gap_max_ms']:.1f} | {r['elapsed_s']:.1f} |")
    r = rows["1p1d"]
    if r["handoffs"]:
        print(f"\n1p1d KV handoffs: {r['handoffs']} ({r['handoff_failures']} failed), "
              f"{r['handoff_MB']:.1f} MB, {1e3 * r['handoff_s'] / r['handoffs']:.1f} ms each "
              "from the first token to the decode side's acknowledgement, of which "
              f"{1e3 * r['handoff_export_s'] / r['handoffs']:.1f} ms until the export was "
              "ready (queueing behind steps included)")
    ratio = rows["1p1d"]["tpot_p99_ms"] / rows["mixed"]["tpot_p99_ms"]
    print(f"\np99 TPOT 1p1d / mixed: {ratio:.2f}")


if __name__ == "__main__":
    main()
