"""Sparse-retrieval attention against dense, in one process on the same inputs (issue #13).

- ``attention``: a decode step's attention (the default model's 30 layers and head
  shape, fp32 KV, the compiled CPU kernel), dense against sparse with the step's table
  layout and every layer's selection included, at
  8K-128K tokens and batch 1 and 8, with the reference design's defaults and with a
  2K-token budget (128 initial + 896 local + 1024 selected tokens). The bound is the
  share of tokens attended: dense tokens ÷ attended tokens; the target is 80% of it.
- ``decode-step``: a whole decode step of a tiny random model at 64K tokens, dense
  against sparse+offload: time, and the device KV bytes the sequence holds (target:
  at most 35% of dense).
- ``capacity``: how many 64K-token sequences decode at once in one device KV budget
  (four dense sequences' worth, each with room for 1024 generated tokens), dense against
  offload, by running the real batch scheduler and tier planner on that budget with
  stand-in model outputs, 16 requests arriving together (target: 2.5x).

    python -m cluster bench long-context [--parts attention decode-step capacity]
        [--json PATH] [--plot PNG]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.common import NUM_THREADS
from kvcache.config import CacheConfig
from kvcache.kv_cache_manager import KVCacheManager
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.long_context import KVMode, LongContextConfig
from scheduler.batch_scheduler import BatchScheduler
from scheduler.config import SchedulerConfig
from scheduler.protocol import (
    ContinuedSequence,
    NewSequence,
    SamplingParams,
    SequenceOutput,
    StepOutput,
    StepPlan,
)
from scheduler.tiering import TierPlanner
from workers.ops import get_ops
from workers.ops.base import AttentionMetadata
from workers.sparse_attention import LongContextAttention
from workers.sparse_step import SeqTierState

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64          # SmolLM2-135M's attention
DEFAULTS = LongContextConfig(enabled=True, dense_boundary=8448,
                             offload_boundary=1 << 20)
BUDGET_2K = LongContextConfig(enabled=True, initial_tokens=128, local_tokens=896,
                              top_k_tokens=1024, dense_boundary=2048 + 128,
                              offload_boundary=1 << 20)


def median_ms(fns: Sequence[Callable[[], None]], repeats: int) -> list[float]:
    """Each function's median time in ms, the functions taking turns in every round, so
    that the machine's drift between rounds falls on all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(spent) for spent in times]


# ---- attention -------------------------------------------------------------------------
def attention_speed(context: int, batch: int, config: LongContextConfig, layers: int,
                    repeats: int) -> dict[str, float]:
    """Milliseconds of a decode step's attention over ``layers`` layers, dense and sparse
    (its once-per-step table layout and each layer's selection included), and the bound
    dense tokens ÷ attended tokens. One layer's KV stands in for every layer's."""
    ops = get_ops(torch.device("cpu"))
    blocks = context // BLOCK
    shape = KVShape(1, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    g = torch.Generator().manual_seed(0)
    (kv,) = allocate_kv_cache(shape, batch * blocks, torch.device("cpu"))
    kv.normal_(generator=g)
    # Every sequence's blocks interleaved with the others', as after many allocations.
    tables = torch.arange(batch * blocks).view(blocks, batch).t().contiguous()
    meta = AttentionMetadata(tables[:, -1] * BLOCK + BLOCK - 1, batch, tables,
                             torch.full((batch,), context), [], BLOCK)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    scale = HEAD_DIM ** -0.5
    lc = LongContextAttention(config, shape, batch * blocks, torch.device("cpu"),
                              ops.block_selector(config.summary))
    lc.summarize_blocks([kv], list(range(batch * blocks)), [BLOCK] * (batch * blocks))
    decodes = [(SeqTierState(KVMode.SPARSE, context), context) for _ in range(batch)]
    step = lc.step([], decodes, meta)
    dense_ms, layout_ms, layer_ms = median_ms(
        [lambda: ops.attention(q, q, q, kv, meta, scale), lambda: lc.step([], decodes, meta),
         lambda: ops.attention(q, q, q, kv, step.decode_meta(0, q, kv), scale)], repeats)
    dense, sparse = layers * dense_ms, layout_ms + layers * layer_ms
    attended = config.layout(context).num_attended_tokens
    return {"context": context, "batch": batch, "dense_ms": dense, "sparse_ms": sparse,
            "layout_ms": layout_ms, "speedup": dense / sparse, "bound": context / attended,
            "of_bound": dense / sparse / (context / attended)}


# ---- a whole decode step -----------------------------------------------------------------
def tiny_long_checkpoint(directory: Path, max_positions: int):
    """A random Llama-shaped checkpoint (the default model's head shape, 4 layers) with
    a context window of ``max_positions``."""
    import transformers as tf

    from workers.loading import load_checkpoint

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=max_positions,
                         tie_word_embeddings=True)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return load_checkpoint(str(directory))


def decode_step(checkpoint, context: int, batch: int, config: LongContextConfig | None,
                steps: int) -> dict[str, float]:
    """A decode step's milliseconds and the device KV the batch holds, for sequences of
    ``context`` tokens whose KV (random) is already in the pool."""
    from workers.model_runner import ModelRunner

    blocks_per_seq = -(-(context + steps + 1) // BLOCK)
    num_blocks = batch * blocks_per_seq + 64
    cache = CacheConfig(block_size=BLOCK)
    runner = ModelRunner(checkpoint, cache, torch.device("cpu"), context + steps + 2,
                         num_blocks=num_blocks, long_context=config)
    g = torch.Generator().manual_seed(0)
    for kv in runner.kv_caches:
        kv.normal_(generator=g)
    kv_manager = KVCacheManager(num_blocks, BLOCK, enable_caching=False)
    tiers = (TierPlanner(config, kv_manager, runner.long_context.host.num_blocks)
             if runner.long_context is not None else None)
    sampling = SamplingParams(temperature=0, max_tokens=None)
    tokens = [torch.randint(3, 500, (context,), generator=g).tolist() for _ in range(batch)]
    plan = StepPlan(0)
    for i, toks in enumerate(tokens):
        seq = f"s{i}"
        ids = kv_manager.allocate(seq, toks, context, 0)
        plan.new.append(NewSequence(seq, toks, context - 1, context - 1, ids, 1, sampling))
    if runner.long_context is not None:
        every = list(range(num_blocks))
        runner.long_context.summarize_blocks(runner.kv_caches, every, [BLOCK] * num_blocks)
        for i in range(batch):
            tiers.prepare(f"s{i}", context)
        plan.tiers = tiers.take_changes()
    runner.execute(plan)   # the offload copies, if any, happen in this first step
    held = sum(kv_manager.num_held_blocks(f"s{i}") for i in range(batch))
    times = []
    for step in range(1, steps + 1):
        plan = StepPlan(step)
        for i in range(batch):
            seq = f"s{i}"
            length = context + step
            if tiers is not None:
                tiers.prepare(seq, length)
            added = kv_manager.allocate(seq, tokens[i], 1, length - 1)
            plan.continued.append(ContinuedSequence(seq, added, 1))
            tokens[i] = runner.seqs[seq].token_ids
        if tiers is not None:
            plan.tiers = tiers.take_changes()
        t0 = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - t0)
    bytes_per_block = runner.kv_shape.bytes_per_block
    summary_bytes = 0
    if runner.long_context is not None:
        # Pool summaries of the blocks held, and each sequence's middle summaries.
        lc = runner.long_context
        summary_bytes = lc.summaries[:, 0].nbytes * held + sum(
            st.tier.summaries.nbytes for st in runner.seqs.values() if st.tier is not None)
    stats = runner.long_context.stats if runner.long_context is not None else None
    hit_rate = (stats.recall_hits / max(stats.recall_hits + stats.recalled_blocks, 1)
                if stats else 0.0)
    return {"step_ms": 1e3 * statistics.median(times[1:]),
            "device_kv_bytes": held * bytes_per_block, "summary_bytes": summary_bytes,
            "recall_hit_rate": hit_rate}


# ---- capacity ----------------------------------------------------------------------------
def capacity(context: int, dense_seqs: int, config: LongContextConfig | None,
             requests: int, max_tokens: int = 1024) -> dict[str, int]:
    """Most sequences decoding at once in a device pool that holds ``dense_seqs`` dense
    sequences of ``context`` prompt tokens plus ``max_tokens`` generated ones, when
    ``requests`` such requests arrive together."""
    blocks_per_seq = -(-(context + max_tokens) // BLOCK)
    kv = KVCacheManager(dense_seqs * blocks_per_seq, BLOCK, enable_caching=False)
    tiers = TierPlanner(config, kv, requests * blocks_per_seq) if config is not None else None
    sched = BatchScheduler(SchedulerConfig(max_num_seqs=requests), kv,
                           context + max_tokens + 1, [2], tiers)
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(requests):
        sched.add(f"r{i}", torch.randint(3, 500, (context,), generator=g).tolist(), sampling)
    best = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        outputs = [SequenceOutput(s.seq_id, [7]) for s in
                   (sched.seqs[p.seq_id] for p in [*plan.new, *plan.continued])
                   if s.num_computed_tokens == s.num_tokens]
        sched.update(StepOutput(plan.step_id, outputs))
        best = max(best, sum(1 for s in sched.running if s.num_output_tokens > 0))
    return {"decoding": best, "preemptions": sched.num_preemptions}


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m benchmarks.long_context") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["attention", "decode-step", "capacity"],
                   choices=["attention", "decode-step", "capacity"])
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--plot", type=Path, help="write the attention figure here (PNG)")
    args = p.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                           "cpu": platform.processor() or platform.machine()}
    if "attention" in args.parts:
        print("| budget | context | batch | dense ms | sparse ms | speedup | bound | "
              "of bound |\n|---|---|---|---|---|---|---|---|")
        rows = []
        for name, cfg in (("defaults", DEFAULTS), ("2K tokens", BUDGET_2K)):
            for context in args.context:
                for batch in args.batch:
                    r = attention_speed(context, batch, cfg, 30, args.repeats)
                    rows.append({"budget": name, **r})
                    print(f"| {name} | {context} | {batch} | {r['dense_ms']:.2f} | "
                          f"{r['sparse_ms']:.2f} | {r['speedup']:.2f}x | {r['bound']:.2f}x | "
                          f"{r['of_bound']:.0%} |", flush=True)
        out["attention"] = rows
        if args.plot:
            from benchmarks.plot import plot_long_context

            plot_long_context(rows, args.plot)
    if "decode-step" in args.parts:
        sparse = LongContextConfig(enabled=True, dense_boundary=16384, offload_boundary=1 << 20)
        offload = LongContextConfig(enabled=True, dense_boundary=16384, offload_boundary=16384)
        rows = []
        print("\n| batch | mode | step ms | device KV MiB | ÷ dense | summaries MiB | "
              "recall hits |\n|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = tiny_long_checkpoint(Path(tmp), 65536 + 64)
            for batch in (1, 4):
                results = [(mode, decode_step(ckpt, 65536, batch, cfg, 6)) for mode, cfg in
                           (("dense", None), ("sparse", sparse), ("sparse+offload", offload))]
                dense_bytes = results[0][1]["device_kv_bytes"]
                for mode, r in results:
                    share = r["device_kv_bytes"] / dense_bytes
                    rows.append({"batch": batch, "mode": mode, **r, "of_dense": share})
                    print(f"| {batch} | {mode} | {r['step_ms']:.1f} | "
                          f"{r['device_kv_bytes'] / 2**20:.0f} | {share:.0%} | "
                          f"{r['summary_bytes'] / 2**20:.1f} | {r['recall_hit_rate']:.0%} |",
                          flush=True)
        out["decode_step"] = rows
    if "capacity" in args.parts:
        offload = LongContextConfig(enabled=True, dense_boundary=16384, offload_boundary=16384)
        dense = capacity(65536, 4, None, 16)
        tiered = capacity(65536, 4, offload, 16)
        print(f"\ncapacity, 64K-token sequences decoding at once in 4 dense sequences' device "
              f"KV: dense {dense['decoding']}, offload {tiered['decoding']} "
              f"({tiered['decoding'] / dense['decoding']:.2f}x)")
        out["capacity"] = {"dense": dense, "offload": tiered}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
