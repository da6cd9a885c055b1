"""``python -m cluster bench quantization``: batch-1 decode speed of the default model
with fp32, w8a16 and w8a8 linear layers, against HF transformers ``generate`` and
llama.cpp (on the GGUF's own Q4_1 weights); Workload A's offline throughput with w8a8 or
w8a16 and int8 KV against fp32 with fp16 KV (the offline benchmark's engine setting);
and how many sequences one KV budget holds with int8 against fp16 KV.

Decode: one request at a time, a short prompt and ``--tokens`` greedy tokens (EOS
ignored), so the time is the decode steps; every configuration runs once per round, in
rotating order, for ``--rounds`` rounds in one process on the same prompt; the median
round is reported with its ratio to llama.cpp. Workload A: ``--requests`` requests of
``benchmarks.workloads.WORKLOAD_A`` (seed 0) submitted at once, prefix caching off,
through the engine with fp32 + fp16 KV and with w8a8 or w8a16 + int8 KV, once per round
in rotating order for ``--rounds`` rounds, each with the fraction of its linear-layer
roofline (``benchmarks.roofline``: the same linear layers, as quantized, timed alone
at the step sizes the run had), and HF ``generate`` once. Capacity: the
KV blocks the engine allocates in ``--kv-bytes``, from its own pool sizing.

    python -m cluster bench quantization [--tokens 64] [--rounds 3] [--requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.peers import llama_cpp
from benchmarks.peers.common import NUM_THREADS, PeerResult, default_hf_dir
from cluster import LLM, SamplingParams

PARTS = ("decode", "workload-a", "capacity")
HF_BATCH = 64   # HF generate's static batch size (the offline benchmark's)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def engine_runner(quantization: str, prompt: list[int], tokens: int) -> Callable[[], int]:
    llm = LLM(device="cpu", kv_cache_bytes=64 << 20, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return lambda: len(llm.generate({"prompt_token_ids": prompt}, params,
                                    use_tqdm=False)[0].outputs[0].token_ids)


def hf_runner(prompt: list[int], tokens: int) -> Callable[[], int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_hf_dir()),
                                              dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def run() -> int:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=tokens, min_new_tokens=tokens)
        return out.shape[1] - len(prompt)
    return run


def llama_cpp_runner(prompt: list[int], tokens: int) -> Callable[[], int]:
    llm = llama_cpp.load()
    return lambda: len(llama_cpp.generate(llm, prompt, tokens))


def decode_speeds(tokens: int, rounds: int) -> dict[str, list[float]]:
    """Output tokens/s of every configuration, per round."""
    torch.set_num_threads(NUM_THREADS)
    probe = LLM(device="cpu", kv_cache_bytes=16 << 20)
    tok = probe.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]),
                        add_special_tokens=False)
    runners: dict[str, Callable[[], int]] = {
        f"engine {q}": engine_runner(q, prompt, tokens) for q in ("none", "w8a16", "w8a8")}
    runners["HF generate fp32"] = hf_runner(prompt, tokens)
    ok, why = llama_cpp.available()
    if ok:
        runners["llama.cpp Q4_1"] = llama_cpp_runner(prompt, tokens)
    else:
        print(f"llama.cpp skipped: {why}")
    for run in runners.values():   # warm-up: weight pages, kernels, buffers
        run()
    speeds: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            n = runners[name]()
            speeds[name].append(n / (time.perf_counter() - start))
    return speeds


ENGINE_RUNS = {   # Workload A's engine configurations: (label, engine.run settings)
    "engine fp32, fp16 KV": {"kv_cache_dtype": "float16"},
    "engine w8a8, int8 KV": {"kv_cache_dtype": "int8", "quantization": "w8a8"},
    "engine w8a16, int8 KV": {"kv_cache_dtype": "int8", "quantization": "w8a16"},
}


def workload_a(requests: int, rounds: int) -> tuple[dict[str, list[PeerResult]], PeerResult]:
    """Workload A through the engine in each of ``ENGINE_RUNS``' settings, once
    per round in rotating order (each run with its linear-layer roofline, timed after
    it), then HF ``generate`` in static batches of 64 once: one process, the same
    prompts. Interleaved rounds keep the ratio honest on a machine whose load changes."""
    import json

    from benchmarks.peers import engine, hf_static
    from benchmarks.workloads import WORKLOAD_A, generate

    vocab = json.loads((default_hf_dir() / "config.json").read_text())["vocab_size"]
    work = generate(WORKLOAD_A, requests, 0, vocab)
    p, m = work.prompts, work.max_tokens
    runs: dict[str, list[PeerResult]] = {name: [] for name in ENGINE_RUNS}
    names = list(ENGINE_RUNS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(engine.run(p, m, None, enable_prefix_caching=False,
                                         **ENGINE_RUNS[name]))
    return runs, hf_static.run(p, m, HF_BATCH)


def kv_capacity(kv_bytes: int) -> dict[str, int]:
    """Blocks of the default model's KV that ``kv_bytes`` holds, per KV dtype."""
    return {dtype: LLM(device="cpu", kv_cache_bytes=kv_bytes,
                       kv_cache_dtype=dtype).engine.runner.num_blocks
            for dtype in ("float16", "int8")}


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of decode and of Workload A (default 3)")
    p.add_argument("--kv-bytes", type=int, default=256 << 20, help="KV budget for capacity")
    p.add_argument("--requests", type=int, default=64, help="Workload A requests (default 64)")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="what to run")
    args = p.parse_args(argv)
    if "decode" in args.parts:
        print_decode(args.tokens, args.rounds)
    if "workload-a" in args.parts:
        print_workload_a(args.requests, args.rounds)
    if "capacity" in args.parts:
        cap = kv_capacity(args.kv_bytes)
        print(f"\nKV capacity in {args.kv_bytes >> 20} MiB: fp16 {cap['float16']} blocks, "
              f"int8 {cap['int8']} blocks: {cap['int8'] / cap['float16']:.3f}x the sequences")
    return 0


def print_decode(tokens: int, rounds: int) -> None:
    speeds = decode_speeds(tokens, rounds)
    ref = statistics.median(speeds["llama.cpp Q4_1"]) if "llama.cpp Q4_1" in speeds else None
    print(f"\nBatch-1 decode, {tokens} tokens, median of {rounds} interleaved "
          "rounds\n\n| configuration | tok/s (median) | rounds | ÷ llama.cpp |\n|---|---|---|---|")
    for name, s in speeds.items():
        ratio = f"{statistics.median(s) / ref:.2f}x" if ref else "n/a"
        print(f"| {name} | {statistics.median(s):.1f} | {', '.join(f'{x:.1f}' for x in s)} "
              f"| {ratio} |")


def print_workload_a(requests: int, rounds: int) -> None:
    runs, hf = workload_a(requests, rounds)
    base = [r.output_tokens_per_s for r in runs["engine fp32, fp16 KV"]]
    hf_tps = hf.output_tokens_per_s
    print(f"\nWorkload A, {requests} requests, greedy, prefix caching off, {rounds} "
          "interleaved rounds (median; ÷ engine fp32 is the median of the rounds' "
          "ratios)\n\n| run | output tok/s (median) | rounds | ÷ engine fp32 | "
          "÷ HF generate | linear-layer roofline (median round) |\n|---|---|---|---|---|---|")
    for name, results in runs.items():
        tps = [r.output_tokens_per_s for r in results]
        mid = sorted(results, key=lambda r: r.output_tokens_per_s)[len(results) // 2]
        frac = mid.extra.get("roofline_fraction")
        roof = f"{frac:.1%} ({mid.extra['roofline_s']:.1f} of {mid.elapsed_s:.1f} s)"
        ratio = statistics.median(t / b for t, b in zip(tps, base))
        print(f"| {name} | {statistics.median(tps):.1f} | "
              f"{', '.join(f'{t:.1f}' for t in tps)} | {ratio:.2f}x | "
              f"{statistics.median(tps) / hf_tps:.2f}x | {roof} |")
    print(f"| HF generate fp32 | {hf_tps:.1f} | 1 run | "
          f"{hf_tps / statistics.median(base):.2f}x | 1.00x | n/a |")
