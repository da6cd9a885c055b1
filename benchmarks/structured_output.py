"""``python -m cluster bench structured``: what structured output costs in throughput.

Workload A on the engine twice per round, the same requests each time: once plain and
once with a JSON schema on every request, the runs interleaved (plain, schema, plain,
schema, ...) in fresh processes, so drift on a shared machine hits both alike. The
schema keeps every request inside the grammar for its whole output (an array of at
least 256 strings cannot close within Workload A's at most 256 tokens), so every
sampled token pays for its mask. Reports each run and the throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.peers.common import run_isolated
from benchmarks.workloads import QUICK, WORKLOAD_A, generate

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string"}, "minItems": 256}}, "required": ["items"]}
VOCAB = 49152  # the default model's


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m cluster bench structured") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64, help="requests (default: 64)")
    p.add_argument("--rounds", type=int, default=2, help="plain+schema pairs (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    shape = QUICK["A"] if args.quick else WORKLOAD_A
    work = generate(shape, args.num_requests, args.seed, VOCAB)
    runs: dict[str, list[float]] = {"plain": [], "schema": []}
    for r in range(args.rounds):
        for label, schema in (("plain", None), ("schema", SCHEMA)):
            res = run_isolated("engine", work.prompts, work.max_tokens, None, None,
                               {"roofline": False, "json_schema": schema,
                                "kv_cache_dtype": "float16"})
            runs[label].append(res.output_tokens_per_s)
            print(f"round {r + 1} {label}: {res.output_tokens} tokens in {res.elapsed_s:.1f} s, "
                  f"{res.output_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    plain, schema = statistics.median(runs["plain"]), statistics.median(runs["schema"])
    ratio = schema / plain
    print(f"Workload A, {args.num_requests} requests, {args.rounds} rounds: plain "
          f"{plain:.1f} tok/s, JSON schema {schema:.1f} tok/s (medians); schema/plain "
          f"{ratio:.3f} ({(1 - ratio) * 100:.1f}% slower; target <= 10%)")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "ratio": ratio, "schema": SCHEMA,
                                        "num_requests": args.num_requests}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
