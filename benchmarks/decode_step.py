"""Where one decode step's time goes: the default model at batch B and context L.

For each ops backend (``auto``: the compiled CPU kernels; ``torch``: the reference they
replace) and KV dtype, times a whole decode step (forward and LM head) on a paged pool
whose blocks are spread like a busy server's, the same step with attention skipped, and
the linear layers alone (``benchmarks.roofline``), in one process on the same weights.
attention = step - step without attention; other (norms, rotary, KV writes, activation,
dispatch) = step without attention - linear layers. ``--pools private shared`` times the
pool a single process allocates (layer-major) and the one a cluster worker keeps in a
shared segment (block-major, ``kvcache/kv_tensors``) on the same blocks.

    python -m cluster bench decode-step --batch 64 128 --context 300 [--pools private shared]
    python -m cluster bench decode-step --batch 32 64 --quantization w8a8 --kv-dtype int8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.peers.common import NUM_THREADS
from benchmarks.roofline import linear_layers_time, lm_head_time
from kvcache.config import CacheConfig
from workers.device import DEFAULT_BLOCK_SIZE
from workers.loading import load_checkpoint
from workers.model_runner import ModelRunner
from workers.ops.base import AttentionMetadata
from workers.ops.quant_linear import QUANTIZATIONS


def median_s(fn: Callable[[], float], repeats: int) -> float:
    """Median of ``repeats`` timings after two untimed calls."""
    fn()
    fn()
    return statistics.median(fn() for _ in range(repeats))


def step_split(runner: ModelRunner, batch: int, context: int, repeats: int) -> dict[str, float]:
    """Milliseconds of a decode step, of its attention, of everything else outside the
    linear layers, and of the linear layers (LM head included) alone."""
    model, bs = runner.model, runner.block_size
    blocks = -(-context // bs)
    # Every sequence's blocks interleaved with the others', as after many allocations.
    tables = torch.arange(batch * blocks).view(blocks, batch).t().contiguous()
    meta = AttentionMetadata(tables[:, -1] * bs + (context - 1) % bs, batch, tables,
                             torch.full((batch,), context), [], bs)
    ids = torch.randint(100, 40000, (batch,), generator=torch.Generator().manual_seed(0))
    positions = torch.full((batch,), context - 1)

    def step() -> float:
        start = time.perf_counter()
        model.compute_logits(model.forward(ids, positions, runner.kv_caches, meta))
        return time.perf_counter() - start

    full = median_s(step, repeats)
    real = model.ops.attention
    model.ops.attention = lambda q, k, v, kv, m, scale: q.clone()
    try:
        no_attention = median_s(step, repeats)
    finally:
        model.ops.attention = real
    linear = (median_s(lambda: linear_layers_time(model, batch), repeats)
              + median_s(lambda: lm_head_time(model, batch), repeats))
    return {"step": 1e3 * full, "attention": 1e3 * (full - no_attention),
            "other": 1e3 * (no_attention - linear), "linear": 1e3 * linear}


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.decode_step") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    p.add_argument("--context", type=int, nargs="+", default=[300])
    p.add_argument("--ops", nargs="+", default=["auto", "torch"], choices=["auto", "torch"],
                   help="auto: the compiled CPU kernels; torch: the reference ops")
    p.add_argument("--kv-dtype", nargs="+", default=["auto", "float16"],
                   choices=["auto", "float16", "bfloat16", "int8"])
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="the linear layers' (w8a8: SmoothQuant calibration at load)")
    p.add_argument("--pools", nargs="+", default=["private"], choices=["private", "shared"],
                   help="private: a process's own pool (layer-major); shared: a cluster "
                        "worker's, in a shared segment (block-major)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    checkpoint = load_checkpoint(None)
    block_size = DEFAULT_BLOCK_SIZE["cpu"]
    num_blocks = max(args.batch) * -(-max(args.context) // block_size)
    print("| ops | KV dtype | pool | batch | context | step ms | attention ms | other ms | "
          "linear ms | linear ÷ step |\n|---|---|---|---|---|---|---|---|---|---|")
    for ops in args.ops:
        for kv_dtype in args.kv_dtype:
            runners = {pool: ModelRunner(checkpoint, CacheConfig(kv_dtype=kv_dtype),
                                         torch.device("cpu"), max(args.context) + 1,
                                         num_blocks=num_blocks, ops=ops,
                                         shared_pool=pool == "shared",
                                         quantization=args.quantization)
                       for pool in args.pools}
            for batch in args.batch:
                for context in args.context:
                    for pool, runner in runners.items():   # in turns, on the same blocks
                        r = step_split(runner, batch, context, args.repeats)
                        print(f"| {runner.ops.name} | {runner.kv_shape.dtype} | {pool} | "
                              f"{batch} | {context} | {r['step']:.1f} | {r['attention']:.1f} | "
                              f"{r['other']:.1f} | {r['linear']:.1f} | "
                              f"{r['linear'] / r['step']:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
