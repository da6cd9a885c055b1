"""``python -m cluster bench offline``: the engine against its peers on the same prompts.

Runs Workload A on this engine (prefix caching on and off), HF ``generate`` on static
batches, HF ``generate_batch`` and llama.cpp; Workload B on the engine with prefix
caching on and off; a throughput sweep over concurrency. Each run is a fresh process
(``benchmarks.peers.common.run_isolated``), so peak memory is the peer's own. A peer that
cannot run here is skipped with the reason, one that fails is reported with its error,
and the others go on. Writes a JSON file with everything, a Markdown report (also
printed) and a PNG of the sweep to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.peers.common import (
    NUM_THREADS,
    Workload,
    default_hf_dir,
    peer_available,
    run_isolated,
)
from benchmarks.plot import plot_sweep
from benchmarks.workloads import QUICK, SWEEP, WORKLOAD_A, WORKLOAD_B, Shape, generate, sweep_size
from kvcache.config import KV_DTYPES

CONCURRENCY = (1, 4, 16, 64, 128)


@dataclass(frozen=True)
class Peer:
    """One configuration to run: a peer module and the options its ``run`` takes."""

    label: str
    module: str
    options: dict[str, Any] = field(default_factory=dict)


ENGINE = Peer("engine", "engine")
ENGINE_NO_CACHE = Peer(report.ENGINE, "engine", {"enable_prefix_caching": False})
HF_STATIC, HF_CONTINUOUS, LLAMA_CPP = (Peer(m, m) for m in
                                       ("hf_static", "hf_continuous", "llama_cpp"))
ALL = (ENGINE, ENGINE_NO_CACHE, HF_STATIC, HF_CONTINUOUS, LLAMA_CPP)
# The sweep needs only throughput: no roofline timing after each point.
SWEEP_ENGINE = Peer(ENGINE_NO_CACHE.label, "engine", {**ENGINE_NO_CACHE.options, "roofline": False})


def build_parser(prog: str = "python -m cluster bench offline") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="The engine against HF transformers and "
                                "llama.cpp on the same prompts, with the roofline, KV memory "
                                "and a concurrency sweep (see benchmarks/offline.py).")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per workload (default: 256; 8 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--skip", nargs="+", default=[], choices=[x.label for x in ALL],
                   metavar="PEER", help="peers not to run: " + ", ".join(x.label for x in ALL))
    p.add_argument("--only-workload", choices=("A", "B"), help="run one workload only")
    p.add_argument("--no-sweep", action="store_true", help="skip the concurrency sweep")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help=f"sweep points (default: {' '.join(map(str, CONCURRENCY))}; "
                        f"1 4 with --quick)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="the engine's KV budget (default: the engine's, 2 GiB on a CPU)")
    p.add_argument("--kv-cache-dtype", default="float16", choices=KV_DTYPES,
                   help="how the engine stores KV; compute stays fp32 (default: float16, "
                        "which halves the bytes its attention reads; auto: the model's fp32)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds one peer run may take before it counts as failed")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                   help="folder for the JSON, Markdown and PNG (default: benchmarks/results)")
    p.add_argument("--quick", action="store_true",
                   help="smoke-test sizes: tiny prompts and outputs, a short sweep")
    return p


@dataclass
class Runner:
    """Runs peers in fresh processes, remembering which cannot run here."""

    skip: set[str]
    engine_options: dict[str, Any]
    timeout_s: float | None
    _why_not_cache: dict[str, str] = field(default_factory=dict)  # module -> "" if it can run

    def __call__(self, peer: Peer, workload: Workload, concurrency: int | None,
                 tag: str) -> dict[str, Any]:
        """The peer's entry for the report: its result, why it was skipped, or its error."""
        reason = self._why_not(peer)
        if reason:
            _log(f"[{tag}] {peer.label}: skipped ({reason})")
            return {"skipped": reason}
        options = {**(self.engine_options if peer.module == "engine" else {}), **peer.options}
        try:
            result = run_isolated(peer.module, workload.prompts, workload.max_tokens,
                                  concurrency, self.timeout_s, options)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            _log(f"[{tag}] {peer.label}: FAILED: {e}")
            return {"error": str(e)}
        _log(f"[{tag}] {peer.label}: {result.output_tokens_per_s:.1f} output tok/s, "
             f"{result.output_tokens} tokens in {result.elapsed_s:.1f} s")
        return {"result": asdict(result)}

    def _why_not(self, peer: Peer) -> str:
        if peer.label in self.skip:
            return "--skip"
        if peer.module not in self._why_not_cache:
            ok, why = peer_available(peer.module)
            self._why_not_cache[peer.module] = "" if ok else why
        return self._why_not_cache[peer.module]


def memory_figure(entry: dict[str, Any], workload: Workload, max_model_len: int) -> dict[str, Any]:
    """Peak concurrent sequences in the engine's KV budget (bytes) against a contiguous
    cache of one max-length slab per sequence in the same bytes: at the model's dtype, as
    HF keeps its cache, for the workload's ``max_model_len`` (the target), for its longest
    request and for the engine's served max_model_len; and at the engine's own KV dtype,
    which isolates what paging alone gains."""
    if "result" not in entry:
        return {}
    x = entry["result"]["extra"]
    pool, served = x["kv_pool_tokens"], x["max_model_len"]
    budget = pool * x["kv_bytes_per_token"]
    model_bytes = x.get("model_dtype_kv_bytes_per_token", x["kv_bytes_per_token"])
    longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens))
    per_workload, per_longest, per_served = (budget // (n * model_bytes)
                                             for n in (max_model_len, longest, served))
    same_dtype = pool // max_model_len
    peak, util = x["peak_running"], x["kv_utilisation_at_peak"]
    kv_dtype = x.get("kv_dtype", "model dtype")
    return {
        "kv_pool_tokens": pool, "peak_running": peak, "kv_utilisation_at_peak": util,
        "contiguous_seqs_workload": per_workload, "contiguous_seqs_longest": per_longest,
        "contiguous_seqs_served": per_served,
        "contiguous_seqs_same_dtype": same_dtype,
        "vs_contiguous_workload": peak / per_workload if per_workload else None,
        "vs_contiguous_longest": peak / per_longest if per_longest else None,
        "vs_contiguous_served": peak / per_served if per_served else None,
        "vs_contiguous_same_dtype": peak / same_dtype if same_dtype else None,
        "lines": [
            f"KV budget: {budget / report.GIB:.2f} GiB = {pool:,} token slots of "
            f"{x['kv_bytes_per_token']:,} bytes ({kv_dtype}, blocks of {x['block_size']}); "
            f"max_num_seqs {x['max_num_seqs']}, {x['preemptions']} preemptions",
            f"peak concurrent sequences in the paged cache: {peak}, with "
            f"{100 * util:.1f}% of allocated KV slots holding live tokens",
            f"contiguous cache in the same bytes at the model's dtype ({model_bytes:,} bytes per "
            f"token), sized for the workload's max_model_len ({max_model_len} tokens: longest "
            f"prompt + longest output): {per_workload} sequences → paged holds "
            f"{_times(peak, per_workload)}",
            f"the same sized for the longest request this sample drew ({longest} tokens): "
            f"{per_longest} sequences → paged holds {_times(peak, per_longest)}",
            f"the same at the served max_model_len ({served} tokens): {per_served} sequences "
            f"→ paged holds {_times(peak, per_served)}",
            f"paging alone (a contiguous {kv_dtype} cache for the workload's max_model_len): "
            f"{same_dtype} sequences → paged holds {_times(peak, same_dtype)}"],
    }


def _times(a: int, b: int) -> str:
    return f"{a / b:.1f}x as many" if b else "(no contiguous slab fits)"


def run_sweep(run: Runner, shape: Shape, levels: Sequence[int], minimum: int, seed: int,
              vocab: int) -> dict[str, dict[str, Any]]:
    """Each batching peer at every concurrency on ``sweep_size(c)`` requests; llama.cpp
    once, sequentially, on the smallest of those workloads."""
    sweep: dict[str, dict[str, Any]] = {}
    for peer in (SWEEP_ENGINE, HF_STATIC, HF_CONTINUOUS):
        sweep[peer.label] = {str(c): run(peer, generate(shape, sweep_size(c, minimum), seed,
                                                        vocab), c, f"sweep c={c}")
                             for c in levels}
    smallest = generate(shape, sweep_size(min(levels), minimum), seed, vocab)
    sweep[LLAMA_CPP.label] = {"sequential": run(LLAMA_CPP, smallest, None, "sweep")}
    return sweep


def batch1(sweep: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Seconds per output token at concurrency 1 (prefill included), engine and HF generate."""
    return {"engine_s": report.time_per_token(sweep.get(ENGINE_NO_CACHE.label, {}).get("1")),
            "hf_static_s": report.time_per_token(sweep.get(HF_STATIC.label, {}).get("1"))}


def machine() -> str:
    """CPU model, cores, memory and torch version, for the report's header."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem = Path("/proc/meminfo").read_text().split()[1] if Path("/proc/meminfo").is_file() else 0
    return (f"{cpu}, {os.cpu_count()} cores, {int(mem) / (1 << 20):.0f} GiB RAM, "
            f"torch {version('torch')}, {NUM_THREADS} threads per peer")


def _describe(shape: Shape, n: int | str) -> str:
    def span(lo: int, hi: int) -> str:
        return f"{lo}" if lo == hi else f"{lo}–{hi}"

    prefix = f"a shared {shape.shared_prefix}-token prefix + " if shape.shared_prefix else ""
    return (f"{n} requests, prompts {prefix}{span(*shape.prompt_len)} tokens, "
            f"outputs {span(*shape.output_len)} tokens")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, prog: str = "python -m cluster bench offline") -> int:
    args = build_parser(prog).parse_args(argv)
    shapes = QUICK if args.quick else {"A": WORKLOAD_A, "B": WORKLOAD_B, "sweep": SWEEP}
    n = args.num_requests or (8 if args.quick else 256)
    levels = args.concurrency or ((1, 4) if args.quick else CONCURRENCY)
    minimum = 4 if args.quick else 16
    vocab = json.loads((default_hf_dir() / "config.json").read_text())["vocab_size"]
    run = Runner(set(args.skip), {"kv_cache_bytes": args.kv_cache_bytes,
                                  "kv_cache_dtype": args.kv_cache_dtype}, args.timeout)
    started = datetime.now(timezone.utc)
    results: dict[str, Any] = {"meta": {
        "command": " ".join([prog, *(argv if argv is not None else sys.argv[1:])]),
        "date": started.strftime("%Y-%m-%d"), "machine": machine(), "seed": args.seed,
        "workload_a": _describe(shapes["A"], n), "workload_b": _describe(shapes["B"], n),
        "sweep": _describe(shapes["sweep"], f"max(2 × concurrency, {minimum})")}}
    if args.only_workload in (None, "A"):
        a = generate(shapes["A"], n, args.seed, vocab)
        results["workload_a"] = {p.label: run(p, a, None, "A") for p in ALL}
        results["memory"] = memory_figure(results["workload_a"][ENGINE_NO_CACHE.label], a,
                                          shapes["A"].max_model_len)
    if args.only_workload in (None, "B"):
        b = generate(shapes["B"], n, args.seed, vocab)
        results["workload_b"] = {p.label: run(p, b, None, "B") for p in (ENGINE, ENGINE_NO_CACHE)}
    if not args.no_sweep:
        results["sweep"] = run_sweep(run, shapes["sweep"], levels, minimum, args.seed, vocab)
        results["batch1"] = batch1(results["sweep"])
    results["checks"] = [asdict(c) | {"passed": c.passed} for c in report.checks(results)]
    results["meta"]["wall_s"] = time.time() - started.timestamp()
    return _write(results, args.out, started)


def _write(results: dict[str, Any], out: Path, started: datetime) -> int:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"offline-{started.strftime('%Y%m%dT%H%M%SZ')}"
    Path(f"{stem}.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    text = report.markdown(results)
    Path(f"{stem}.md").write_text(text, encoding="utf-8")
    if results.get("sweep"):
        try:
            plot_sweep(results["sweep"], Path(f"{stem}.png"))
        except ModuleNotFoundError as e:
            if e.name != "matplotlib":
                raise
            _log("no plot: matplotlib is not installed (it is in requirements-test.txt)")
    print(text)
    _log(f"wrote {stem}.json, {stem}.md" + (f", {stem}.png" if Path(f"{stem}.png").is_file()
                                             else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.offline"))
