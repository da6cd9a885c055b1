"""First offline throughput figure of the engine on the default model (fp32, CPU).

Workload A's shape: prompt lengths uniform in 32-512 tokens, output lengths uniform
in 16-256 (max_tokens with ignore_eos, so the token count is fixed by the seed),
greedy. Prompts are random token ids, so no prefix is shared.

    python benchmarks/offline_throughput.py [--num-requests 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from cluster import LLM, SamplingParams


def workload_a(n: int, seed: int, vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in
                                     range(rng.randint(32, 512))]} for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(device="cpu", seed=args.seed)
    prompts, params = workload_a(args.num_requests, args.seed, llm.engine.model_config.vocab_size)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    print(json.dumps({
        "requests": len(outs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "requests_per_s": round(len(outs) / elapsed, 3),
        "torch_threads": torch.get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
