"""Global scheduler overhead per step with 256 running sequences, on a real Ray instance.

One mixed worker runs the default model; 256 requests (short random prompts, greedy,
``ignore_eos``) are submitted at once, so after their prefill every step decodes all
256. Over a window of steps where all 256 run, the scheduler's own step-time sums are
differenced: planning (``schedule`` + msgpack encode), the actor call less the
worker's execute time (transport and the worker's msgpack decode/encode), and the
update (msgpack decode, ``BatchScheduler.update``, publishing to the streams).
Overhead is their share of the whole step.

    python benchmarks/cluster_scheduler_overhead.py [--seqs 256] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import random
import time

import ray

from cluster.cluster_engine import ClusterEngine
from cluster.config import config_from_dict
from scheduler.protocol import SamplingParams

PARTS = ("plan_s", "rpc_s", "execute_s", "update_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--cpus", type=float, default=2)
    args = ap.parse_args()
    ray.init(num_cpus=int(args.cpus), include_dashboard=False, log_to_driver=False)
    engine = ClusterEngine(config_from_dict({
        "cache": {"kv_cache_bytes": 512 << 20},
        "scheduler": {"max_num_seqs": args.seqs},
        "cluster": {"name": "bench-overhead",
                    "pools": [{"role": "mixed", "resources": {"CPU": args.cpus}}]}}))
    try:
        rng = random.Random(0)
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.seqs):
            prompt = [rng.randrange(100, 10_000) for _ in range(args.prompt_tokens)]
            engine.add_request(f"r{i}", None, prompt, sp)
        first = last = None
        while engine.has_unfinished():
            engine.step()
            w = engine.stats().workers[0]
            # Every sequence decoding: a window from the third such step on.
            if w.num_running == args.seqs and w.num_steps >= 3:
                first = first or w
                last = w
            if first and last.num_steps - first.num_steps >= args.max_tokens // 2:
                break
        steps = last.num_steps - first.num_steps
        window = {k: (getattr(last.step_times, k) - getattr(first.step_times, k)) / steps
                  for k in PARTS}
    finally:
        engine.shutdown()
        ray.shutdown()
    total = sum(window.values())
    overhead = window["plan_s"] + window["rpc_s"] + window["update_s"]
    print(f"{steps} steps with {args.seqs} running sequences, {time.strftime('%Y-%m-%d')}")
    print("| per step | ms | share |\n|---|---|---|")
    for k in PARTS:
        print(f"| {k[:-2]} | {1e3 * window[k]:.2f} | {window[k] / total:.2%} |")
    print(f"| **overhead (plan + rpc + update)** | {1e3 * overhead:.2f} | "
          f"{overhead / total:.2%} |")


if __name__ == "__main__":
    main()
