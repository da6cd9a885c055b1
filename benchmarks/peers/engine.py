"""Peer: this engine, driven step by step so the run can be profiled while it is timed.

Besides throughput it reports what only the engine can: the per-step time split from
``LocalEngine.step_records``, the prefix-cache hit rate, the peak number of running
sequences with the KV utilisation at that step (live tokens over allocated block slots),
and, timed after the run in the same process, the linear-layer roofline of the steps it
ran (``benchmarks.roofline``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from benchmarks.peers.common import NUM_THREADS, PeerResult, peak_rss_bytes
from benchmarks.roofline import roofline_seconds

if TYPE_CHECKING:
    from cluster.engine import StepRecord
    from scheduler.batch_scheduler import BatchScheduler

NAME = "engine"
# Steps with this many running sequences make the "at 64 running sequences" split.
SPLIT_BAND = (56, 72)
PHASES = ("schedule", "prepare", "forward", "sample", "runner_other", "message", "update")


def available() -> tuple[bool, str]:
    """The engine is this repository: always available."""
    return True, ""


@dataclass
class KVPeak:
    """The step with the most running sequences, and how full its KV blocks were.

    Live tokens count each sequence's own; with prefix caching a shared block holds
    tokens of several sequences, so the utilisation can exceed 1 (the memory figure
    uses the run without it)."""

    running: int = 0
    live_tokens: int = 0
    allocated_slots: int = 0

    def observe(self, scheduler: BatchScheduler) -> None:
        """Called after every step; only a new peak pays for counting tokens."""
        if scheduler.num_running <= self.running:
            return
        self.running = scheduler.num_running
        self.live_tokens = sum(s.num_computed_tokens for s in scheduler.running)
        self.allocated_slots = scheduler.kv.pool.num_used_blocks * scheduler.kv.block_size

    @property
    def utilisation(self) -> float:
        return self.live_tokens / self.allocated_slots if self.allocated_slots else 0.0


def step_split(records: Iterable[StepRecord]) -> dict[str, float | int]:
    """Seconds per phase summed over ``records``, each phase's fraction of the step time,
    and the number of steps."""
    records = list(records)
    totals = dict.fromkeys(PHASES, 0.0)
    for r in records:
        totals["schedule"] += r.schedule_s
        totals["prepare"] += r.prepare_s
        totals["forward"] += r.forward_s
        totals["sample"] += r.sample_s
        totals["runner_other"] += r.runner_s - r.prepare_s - r.forward_s - r.sample_s
        totals["message"] += r.message_s
        totals["update"] += r.update_s
    step_s = sum(totals.values())
    out: dict[str, float | int] = {"steps": len(records), "step_s": step_s}
    for phase, seconds in totals.items():
        out[f"{phase}_s"] = seconds
        out[f"{phase}_frac"] = seconds / step_s if step_s else 0.0
    return out


def run(prompts: list[list[int]], max_tokens: list[int], concurrency: int | None,
        enable_prefix_caching: bool = True, kv_cache_bytes: int | None = None,
        kv_cache_dtype: str = "auto", roofline: bool = True,
        json_schema: dict | None = None, quantization: str = "none") -> PeerResult:
    """Run the workload greedily with ``ignore_eos``; ``concurrency`` is max_num_seqs
    (None: the engine's default); ``kv_cache_dtype`` is how the KV pool stores keys and
    values (compute stays fp32). ``roofline=False`` skips timing the linear layers
    afterwards (a minute at Workload A's sizes), for runs that only need throughput.
    ``json_schema``: every request's output is constrained to it (structured output).
    ``quantization``: the linear layers' (the roofline then times them as run)."""
    from cluster.llm import LLM
    from scheduler.protocol import SamplingParams, StructuredOutputsParams

    torch.set_num_threads(NUM_THREADS)
    limits = {"max_num_seqs": concurrency} if concurrency else {}
    llm = LLM(device="cpu", enable_prefix_caching=enable_prefix_caching,
              kv_cache_bytes=kv_cache_bytes, kv_cache_dtype=kv_cache_dtype,
              quantization=quantization, **limits)
    # Warmup (kernel build and first-call allocations); 8 tokens fill no cacheable block.
    structured = StructuredOutputsParams(json=json_schema) if json_schema else None
    llm.generate({"prompt_token_ids": prompts[0][:8]},   # also builds the grammar tokenizer
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                structured_outputs=structured))
    engine, stats = llm.engine, llm.engine.scheduler.kv.stats
    queried0, hit0 = stats.queried_tokens, stats.hit_tokens
    for i, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"bench-{i}", None, prompt,
                           SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True,
                                          structured_outputs=structured))
    engine.step_records, peak, output_tokens = [], KVPeak(), 0
    start = time.perf_counter()
    while engine.has_unfinished():
        output_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        peak.observe(engine.scheduler)
    elapsed = time.perf_counter() - start
    records = engine.step_records
    roofline_s = roofline_seconds(engine.runner.model,
                                  ((r.num_tokens, r.num_sampled) for r in records)) \
        if roofline else None
    queried, hits = stats.queried_tokens - queried0, stats.hit_tokens - hit0
    runner, block_size = engine.runner, engine.runner.block_size
    kv_bytes_per_token = runner.kv_shape.bytes_per_block // block_size
    extra = {
        "enable_prefix_caching": enable_prefix_caching,
        "max_num_seqs": llm.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "block_size": block_size,
        "kv_pool_tokens": runner.num_blocks * block_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_dtype": str(runner.kv_shape.dtype).removeprefix("torch."),
        # What a token's KV takes at the model's dtype, as a contiguous HF cache keeps it.
        "model_dtype_kv_bytes_per_token": kv_bytes_per_token // runner.kv_shape.dtype.itemsize
        * runner.model.embed.dtype.itemsize,
        "prefix_hit_rate": hits / queried if queried else 0.0,
        "prefix_hit_tokens": hits,
        "preemptions": engine.scheduler.num_preemptions,
        "peak_running": peak.running,
        "kv_utilisation_at_peak": peak.utilisation,
        "split": step_split(records),
        "split_at_64": step_split(r for r in records
                                  if SPLIT_BAND[0] <= r.num_seqs <= SPLIT_BAND[1]),
        "step_tokens_histogram": dict(sorted(Counter(r.num_tokens for r in records).items())),
        "roofline_s": roofline_s,
        "json_schema": json_schema,
        "quantization": quantization,
        "roofline_fraction": roofline_s / elapsed if roofline_s is not None else None,
    }
    mode = "on" if enable_prefix_caching else "off"
    return PeerResult(
        name=NAME if enable_prefix_caching else f"{NAME}_no_prefix_cache",
        num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
        output_tokens=output_tokens, elapsed_s=elapsed, peak_rss_bytes=peak_rss_bytes(),
        notes=f"this engine, fp32 compute, {quantization} quantization, "
              f"{extra['kv_dtype']} KV cache, prefix caching {mode}, "
              f"max_num_seqs "
              f"{extra['max_num_seqs']}, {extra['kv_pool_tokens']} KV token slots, greedy, "
              f"ignore_eos", extra=extra)
