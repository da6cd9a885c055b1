"""End quality of sparse-retrieval attention on the default model, against dense attention.

The one-process engine (fp32, greedy) runs the same inputs in three variants:

- dense: ``long_context.enabled`` false;
- sparse: scaled-down regions (64 initial + 512 local tokens, 32-token retrieval blocks,
  20% of the middle blocks by min/max summary, 16-token pool blocks), ``dense_boundary``
  1024 and ``offload_boundary`` past the model's window: every decode step from 1024
  tokens on is sparse, all KV stays in the device pool;
- offload: the same with ``offload_boundary`` 1024: the middle blocks move to the host
  tier and each step recalls the blocks it selects.

A prompt's prefill is always dense; the decode steps are what differ. Two measures:

1. Passkey retrieval: a random 5-digit passkey (fixed seed) hidden at depths 0..100% of
   the classic filler ("The grass is green. The sky is blue. ..."), prompts of several
   lengths within the window (by default 1.5K to 4K tokens: every prompt is one more
   prefill per variant, about 10 ms a token at 4K on two cores), then "What is the pass
   key? The pass key is" as plain text (the 135M model answers more often without its
   chat template); the answer is decoded greedily: its first token, a space, comes from
   the prefill, the digits from sparse decode steps. Target: each sparse variant's
   accuracy equal to dense's; case-by-case agreement is reported too.
2. Teacher-forced next-token agreement on about 8K tokens of real English text (the
   recall benchmark's: Python's language reference, "Compound statements"): windows of
   the text are prefilled (dense), then decoded one token at a time while a forcing
   sampler records each step's argmax and feeds the text's true next token instead.
   Agreement: the share of decode positions where the variant's argmax equals dense's.
   Target: at least 99%.

    python -m cluster bench long-context-quality [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.long_context_recall import read_text
from benchmarks.long_context_tasks import (
    BLOCK_SIZE,
    MAX_NUM_SEQS,
    VARIANTS,
    WINDOWS,
    ForcedStep,
    PasskeyCase,
    Regions,
    VariantRun,
    Workload,
    engine_config,
    passkey_cases,
    run_variant,
    window_starts,
)
from benchmarks.peers.common import NUM_THREADS
from cluster.llm import LLM
from kvcache.long_context import SUMMARY_KINDS
from workers.loading import default_model_path


def forced_figures(dense: Sequence[ForcedStep], other: Sequence[ForcedStep]) -> dict[str, Any]:
    """Agreement of ``other`` with ``dense`` over the decode rows (a window's first row
    comes from the prefill, dense in every variant), and both variants' fit to the text."""
    ref = {(s.start, s.position): s for s in dense if s.position > s.start}
    rows = [s for s in other if s.position > s.start]
    if sorted(ref) != sorted((s.start, s.position) for s in rows):
        raise ValueError("the two runs forced different positions")
    agree = [s.argmax == ref[s.start, s.position].argmax for s in rows]
    by_window: dict[int, list[bool]] = {}
    for s, a in zip(rows, agree):
        by_window.setdefault(s.start, []).append(a)
    out: dict[str, Any] = {
        "positions": len(rows),
        "agreement": sum(agree) / len(rows),
        "disagreements": len(rows) - sum(agree),
        "agreement_by_window": {str(k): sum(v) / len(v) for k, v in by_window.items()},
        "next_token_accuracy": sum(s.argmax == s.target for s in rows) / len(rows),
        "dense_next_token_accuracy": sum(s.argmax == s.target for s in ref.values()) / len(rows),
    }
    if all(s.logits is not None for s in rows) and all(s.logits is not None
                                                       for s in ref.values()):
        a = torch.stack([s.logits for s in rows])
        d = torch.stack([ref[s.start, s.position].logits for s in rows])
        la, ld = a.log_softmax(-1), d.log_softmax(-1)
        kl = (ld.exp() * (ld - la)).sum(-1)
        diff = (a - d).abs().amax(-1)
        tgt = torch.tensor([s.target for s in rows])
        top2 = ld.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1])[~torch.tensor(agree)]
        out.update({
            "nll": float(-la.gather(1, tgt[:, None]).mean()),
            "dense_nll": float(-ld.gather(1, tgt[:, None]).mean()),
            "kl_from_dense_mean": float(kl.mean()), "kl_from_dense_max": float(kl.max()),
            "max_abs_logit_diff_median": float(diff.median()),
            "max_abs_logit_diff_max": float(diff.max()),
            "dense_margin_at_disagreements": [round(float(m), 4) for m in margin],
        })
    return out

AGREEMENT_TARGET = 0.99


# ---- figures and tables --------------------------------------------------------------
def passkey_figures(cases: Sequence[PasskeyCase],
                    runs: dict[str, VariantRun]) -> dict[str, Any]:
    dense = runs["dense"].passkey if "dense" in runs else None
    out: dict[str, Any] = {}
    for name, run in runs.items():
        res = run.passkey
        f: dict[str, Any] = {"accuracy": sum(r.correct for r in res) / len(res),
                             "correct": sum(r.correct for r in res), "cases": len(res)}
        for key, attr in (("by_length", "length"), ("by_depth", "depth"),
                          ("by_region", "region")):
            groups: dict[str, list[bool]] = {}
            for c, r in zip(cases, res):
                groups.setdefault(str(getattr(c, attr)), []).append(r.correct)
            f[key] = {k: sum(v) / len(v) for k, v in groups.items()}
        if dense is not None and name != "dense":
            f["same_correctness_as_dense"] = sum(
                a.correct == b.correct for a, b in zip(res, dense)) / len(res)
            f["same_text_as_dense"] = sum(a.token_ids == b.token_ids
                                          for a, b in zip(res, dense)) / len(res)
            f["equal_to_dense"] = f["correct"] == sum(r.correct for r in dense)
        out[name] = f
    return out


def _cpu_name() -> str:
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in info.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def _grid_table(title: str, groups: list[str], figs: dict[str, Any], key: str,
                counts: dict[str, int]) -> str:
    names = list(figs)
    rows = [f"| {title} | cases | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for g in groups:
        rows.append(f"| {g} | {counts[g]} | "
                    + " | ".join(f"{figs[n][key].get(g, float('nan')):.2f}" for n in names)
                    + " |")
    return "\n".join(rows)


def passkey_tables(cases: Sequence[PasskeyCase], figs: dict[str, Any],
                   runs: dict[str, VariantRun]) -> str:
    out = []
    for title, attr, key in (("length", "length", "by_length"), ("depth", "depth", "by_depth"),
                             ("needle region", "region", "by_region")):
        counts: dict[str, int] = {}
        for c in cases:
            counts[str(getattr(c, attr))] = counts.get(str(getattr(c, attr)), 0) + 1
        out.append(_grid_table(title, list(counts), figs, key, counts))
    names = list(figs)
    rows = ["| variant | correct | accuracy | same correctness as dense | same text as dense "
            "| run s |", "|---|---|---|---|---|---|"]
    for n in names:
        f = figs[n]
        rows.append(f"| {n} | {f['correct']}/{f['cases']} | {f['accuracy']:.3f} | "
                    f"{f.get('same_correctness_as_dense', 1.0):.3f} | "
                    f"{f.get('same_text_as_dense', 1.0):.3f} | {runs[n].passkey_s:.0f} |")
    out.append("\n".join(rows))
    return "\n\n".join(out)


def forced_table(figs: dict[str, Any], runs: dict[str, VariantRun]) -> str:
    rows = ["| variant | positions | agreement with dense | disagreements | next-token acc. "
            "(dense) | NLL (dense) | KL from dense mean / max | max abs logit diff median / "
            "max | run s |", "|---" * 9 + "|"]
    for n, f in figs.items():
        rows.append(
            f"| {n} | {f['positions']} | {f['agreement']:.4f} | {f['disagreements']} | "
            f"{f['next_token_accuracy']:.3f} ({f['dense_next_token_accuracy']:.3f}) | "
            + (f"{f['nll']:.3f} ({f['dense_nll']:.3f}) | {f['kl_from_dense_mean']:.2e} / "
               f"{f['kl_from_dense_max']:.2e} | {f['max_abs_logit_diff_median']:.3f} / "
               f"{f['max_abs_logit_diff_max']:.3f}" if "nll" in f else "- | - | -")
            + f" | {runs[n].forced_s:.0f} |")
    starts = list(next(iter(figs.values()))["agreement_by_window"])
    rows += ["", "| window start | " + " | ".join(figs) + " |", "|---" * (len(figs) + 1) + "|"]
    for s in starts:
        rows.append(f"| {s} | " + " | ".join(f"{f['agreement_by_window'][s]:.4f}"
                                            for f in figs.values()) + " |")
    for n, f in figs.items():
        margins = f.get("dense_margin_at_disagreements")
        if margins:
            rows.append(f"{n}: dense's top-2 log-prob margin where it disagrees: "
                        + ", ".join(f"{m:.3f}" for m in sorted(margins)))
    return "\n".join(rows)


def passkey_differences(cases: Sequence[PasskeyCase], runs: dict[str, VariantRun]) -> str:
    """The cases whose answer differs from dense's in some variant."""
    lines = []
    for i, c in enumerate(cases):
        answers = {n: r.passkey[i].text for n, r in runs.items()}
        if len(set(answers.values())) > 1:
            lines.append(f"- {len(c.token_ids)} tokens, depth {c.depth} ({c.region}), passkey "
                         f"{c.passkey}: " + "; ".join(
                             f"{n} {a!r}{' ok' if runs[n].passkey[i].correct else ''}"
                             for n, a in answers.items()))
    return "\n".join(lines) or "(every variant gave dense's answer text in every case)"


def _workload(p: argparse.ArgumentParser, args: argparse.Namespace, llm: LLM,
              regions: Regions) -> Workload:
    """The passkey cases and forced windows, built with the first engine's tokenizer and
    checked against its window (errors end the run through ``p.error``)."""
    tok, window = llm.get_tokenizer(), llm.engine.max_model_len
    if tok is None:
        p.error("the model has no tokenizer: the passkey prompts and the text need one")
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if any(not regions.dense_boundary < n <= window - args.answer_tokens for n in lengths):
        p.error(f"--lengths: each must lie above --dense-boundary ({regions.dense_boundary}) "
                f"and at most the window less the answer ({window - args.answer_tokens})")
    depths = ([round(i / (args.depths - 1), 3) for i in range(args.depths)]
              if args.depths > 1 else [0.5])
    cases = passkey_cases(tok, lengths, depths, args.seed, regions) if args.depths else []
    body, source = read_text(args.text)
    text = tok.encode(body)
    tokens = min(args.tokens, window)
    if len(text) < tokens:
        p.error(f"the text has {len(text)} tokens, fewer than --tokens {tokens}")
    try:
        starts = window_starts(args.prefill, tokens, args.steps, args.windows)
    except ValueError as e:
        p.error(f"--prefill/--tokens/--steps/--windows: {e}")
    if starts[0] <= regions.dense_boundary:
        p.error(f"--prefill ({args.prefill}) must exceed --dense-boundary "
                f"({regions.dense_boundary}) so that every forced step is sparse")
    return Workload(cases, args.answer_tokens, text[:tokens], source, starts, args.steps)


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m benchmarks.long_context_quality") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="PATH",
                   help="HF directory or .gguf with a tokenizer (default: the embedded model)")
    p.add_argument("--text", metavar="FILE",
                   help="a UTF-8 text file to force (default: Python's language reference)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, dense first (default: %(default)s)")
    p.add_argument("--lengths", default="1536,2048,3072,4096",
                   help="passkey prompt lengths in tokens (default: %(default)s)")
    p.add_argument("--depths", type=int, default=11,
                   help="passkey depths per length, spread evenly over 0..100%% "
                   "(default: %(default)s; 0: no passkey part)")
    p.add_argument("--answer-tokens", type=int, default=8,
                   help="tokens decoded per passkey answer (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8000,
                   help="tokens of the text to force (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=2000,
                   help="the first window's prompt length, prefilled (default: %(default)s)")
    p.add_argument("--windows", type=int, default=WINDOWS,
                   help="forced windows, spread from --prefill to the text's end "
                   "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=100,
                   help="forced decode steps per window (default: %(default)s; 0: no "
                   "forcing part)")
    p.add_argument("--top-k-percent", type=float, default=Regions.top_k_percent,
                   help="share of the middle blocks attended (default: %(default)s)")
    p.add_argument("--dense-boundary", type=int, default=Regions.dense_boundary,
                   help="decode steps are sparse from this many tokens on; also the offload "
                   "variant's offload boundary (default: %(default)s)")
    p.add_argument("--summary", choices=SUMMARY_KINDS, default=Regions.summary,
                   help="block summary the selection scores (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys (default: 0)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny subset: lengths 1280,1792 x 3 depths; 2 windows x 8 steps "
                   "over 1600 tokens")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.depths, args.tokens = "1280,1792", 3, 1600
        args.prefill, args.windows, args.steps = 1100, 2, 8
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or variants[0] != "dense" or not set(variants) <= set(VARIANTS) \
            or len(set(variants)) != len(variants):
        p.error(f"--variants: got {args.variants!r}; dense first, then sparse and/or offload")
    if args.depths < 0 or args.steps < 0 or (args.depths == 0 and args.steps == 0):
        p.error("--depths and --steps: at least one must be > 0, neither < 0")
    torch.set_num_threads(NUM_THREADS)
    regions = Regions(top_k_percent=args.top_k_percent, dense_boundary=args.dense_boundary,
                      offload_boundary=args.dense_boundary, summary=args.summary)
    t_all = time.perf_counter()
    runs: dict[str, VariantRun] = {}
    work: Workload | None = None
    host_kv_bytes: int | None = None
    window = 0
    for variant in variants:
        t = time.perf_counter()
        llm = LLM(config=engine_config(variant, regions, model=args.model,
                                       host_kv_bytes=host_kv_bytes))
        load_s = time.perf_counter() - t
        try:
            if work is None:
                work = _workload(p, args, llm, regions)
                window = llm.engine.max_model_len
                shape = llm.engine.runner.kv_shape
                # Host room for max_num_seqs whole windows: offloading never waits for it.
                host_kv_bytes = (MAX_NUM_SEQS * -(-window // shape.block_size)
                                 * shape.bytes_per_block)
                _describe(args, variants, regions, work, window)
            runs[variant] = run_variant(llm, variant, work)
            runs[variant].load_s = load_s
        finally:
            llm.shutdown()
            del llm
            gc.collect()
    assert work is not None
    wall = time.perf_counter() - t_all
    pk = passkey_figures(work.cases, runs) if work.cases else {}
    forced = ({n: forced_figures(runs["dense"].forced, r.forced) for n, r in runs.items()
               if n != "dense"} if work.steps else {})
    if pk:
        print("\nPasskey accuracy:\n" + passkey_tables(work.cases, pk, runs)
              + "\n\nAnswers that differ from dense's:\n" + passkey_differences(work.cases, runs))
    if forced:
        print("\nTeacher-forced next-token agreement with dense (decode positions):\n"
              + forced_table(forced, runs))
    verdicts: dict[str, dict[str, bool]] = {}
    for n in variants[1:]:
        v = verdicts[n] = {}
        line = [f"{n}:"]
        if pk:
            v["passkey_equal_to_dense"] = pk[n]["equal_to_dense"]
            line.append(f"passkey accuracy {pk[n]['accuracy']:.3f} vs dense "
                        f"{pk['dense']['accuracy']:.3f}: "
                        f"{'equal' if v['passkey_equal_to_dense'] else 'NOT equal'};")
        if forced:
            v["agreement_meets_target"] = forced[n]["agreement"] >= AGREEMENT_TARGET
            line.append(f"agreement {forced[n]['agreement']:.4f}: "
                        f"{'meets' if v['agreement_meets_target'] else 'misses'} the "
                        f"{AGREEMENT_TARGET} target;")
        line.append(f"tiers {runs[n].tier_stats}")
        print(" ".join(line))
    cpu = _cpu_name()
    print(f"wall time {wall:.0f} s on {cpu}, {NUM_THREADS} threads")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "cpu": cpu, "threads": NUM_THREADS,
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "model": args.model or "default", "window": window, "regions": asdict(regions),
            "block_size": BLOCK_SIZE, "text": work.text_source, "tokens": len(work.text),
            "starts": work.starts, "steps": work.steps, "wall_s": wall,
            "timings": {n: {"load_s": r.load_s, "passkey_s": r.passkey_s,
                            "forced_s": r.forced_s} for n, r in runs.items()},
            "tier_stats": {n: r.tier_stats for n, r in runs.items()},
            "passkey": pk, "forced": forced, "verdicts": verdicts,
            "cases": [{"length": len(c.token_ids), "target_length": c.length,
                       "depth": c.depth, "passkey": c.passkey, "needle_at": c.needle_at,
                       "region": c.region,
                       "answers": {n: r.passkey[i].text for n, r in runs.items()},
                       "correct": {n: r.passkey[i].correct for n, r in runs.items()}}
                      for i, c in enumerate(work.cases)],
        }, indent=1), encoding="utf-8")
    return 0


def _describe(args: argparse.Namespace, variants: list[str], regions: Regions, work: Workload,
              window: int) -> None:
    cases = work.cases
    model = args.model or f"{default_model_path()} (the embedded default)"
    lines = [f"model: {model}, window {window}; variants: {', '.join(variants)}",
             f"regions: {regions}; {BLOCK_SIZE}-token pool blocks"]
    if cases:
        lines.append(
            f"passkey: {len(cases)} cases, lengths {sorted({c.length for c in cases})} (actual "
            f"{min(len(c.token_ids) for c in cases)}..{max(len(c.token_ids) for c in cases)} "
            f"tokens) x depths {sorted({c.depth for c in cases})}, {work.answer_tokens} answer "
            "tokens; needle at the first decode step in region "
            + ", ".join(f"{r}: {sum(c.region == r for c in cases)}"
                        for r in ("initial", "middle", "local")))
    if work.steps:
        compared = len(work.starts) * (work.steps - 1)
        lines.append(f"forced: {work.text_source}; {len(work.text)} tokens, windows at "
                     f"{work.starts}, {work.steps} steps each ({compared} decode positions "
                     "compared)")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
