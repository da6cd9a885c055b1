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
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.long_context_recall import read_text
from benchmarks.peers.common import NUM_THREADS
from cluster.config import EngineConfig, config_from_dict
from cluster.llm import LLM
from kvcache.long_context import SUMMARY_KINDS, LongContextConfig
from scheduler.protocol import SamplingParams
from workers.loading import default_model_path
from workers.sampler import Sampler, SamplerOutput, SamplingRow
from workers.tokenizer import Tokenizer

VARIANTS = ("dense", "sparse", "offload")
AGREEMENT_TARGET = 0.99
BLOCK_SIZE = 16
MAX_NUM_SEQS = 8   # sequences run at once (bounds the host tier an offload run needs)
NEVER = 1 << 30    # the sparse variant's offload boundary: past any window

# The classic passkey prompt (Mohtashami & Jaggi, "Landmark Attention", 2023).
HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about the important information there.\n\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
QUESTION = "\n\nWhat is the pass key? The pass key is"


def needle(passkey: int) -> str:
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "


@dataclass(frozen=True)
class Regions:
    """The scaled-down sparse layout every sparse variant runs with."""

    initial_tokens: int = 64
    local_tokens: int = 512
    retrieval_block_size: int = 32
    top_k_percent: float = 0.2
    dense_boundary: int = 1024
    offload_boundary: int = 1024  # the offload variant's; the sparse one's is past the window
    summary: str = "hybrid"       # how middle blocks are scored (kvcache.long_context)


def engine_config(variant: str, regions: Regions, *, model: str | None = None,
                  host_kv_bytes: int | None = None, kv_cache_bytes: int | None = None,
                  enable_prefix_caching: bool = True) -> EngineConfig:
    """The one-process engine's config of one variant: fp32 on the CPU, the same pool
    and scheduler for all three, only ``long_context`` differing. Every ``long_context``
    field is given, so no ``VLLM_RETRIEVAL_*`` variable changes what runs."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: got {variant!r}; allowed: {', '.join(VARIANTS)}")
    offload = regions.offload_boundary if variant == "offload" else NEVER
    return config_from_dict({
        "model": {"path": model, "dtype": "float32", "device": "cpu"},
        "cache": {"block_size": BLOCK_SIZE, "kv_cache_bytes": kv_cache_bytes,
                  "enable_prefix_caching": enable_prefix_caching},
        "scheduler": {"max_num_seqs": MAX_NUM_SEQS},
        "long_context": {
            "enabled": variant != "dense", "initial_tokens": regions.initial_tokens,
            "local_tokens": regions.local_tokens, "top_k_percent": regions.top_k_percent,
            "top_k_tokens": None, "retrieval_block_size": regions.retrieval_block_size,
            "dense_boundary": regions.dense_boundary,
            "offload_boundary": max(offload, regions.dense_boundary),
            "host_kv_bytes": host_kv_bytes, "reselect_every": 1, "summary": regions.summary},
    })


def layout_config(regions: Regions) -> LongContextConfig:
    """The sparse variants' region rule (for saying where a token lies)."""
    return LongContextConfig(enabled=True, initial_tokens=regions.initial_tokens,
                             local_tokens=regions.local_tokens,
                             top_k_percent=regions.top_k_percent,
                             retrieval_block_size=regions.retrieval_block_size,
                             dense_boundary=regions.dense_boundary,
                             offload_boundary=regions.dense_boundary, summary=regions.summary)


# ---- passkey retrieval ---------------------------------------------------------------
@dataclass
class PasskeyCase:
    length: int          # the prompt's target length in tokens (its actual one: len(token_ids))
    depth: float         # the share of the filler placed before the needle
    passkey: int
    token_ids: list[int]
    needle_at: int       # token index of the passkey's first digit in the needle
    region: str          # where the needle lies at the first decode step: initial/middle/local


def passkey_cases(tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float],
                  seed: int, regions: Regions) -> list[PasskeyCase]:
    """One case per (length, depth), each with its own passkey. The filler is the same
    everywhere, so a case's prompt up to its needle is a prefix of every prompt whose
    needle lies deeper (the prefix cache computes the shared part once)."""
    rng = random.Random(seed)
    lay = layout_config(regions)
    unit = len(tokenizer.encode(FILLER * 9)) - len(tokenizer.encode(FILLER * 8))
    cases = []
    for length in lengths:
        for depth in depths:
            passkey = rng.randint(10000, 99999)
            fixed = len(tokenizer.encode(HEADER + needle(passkey) + QUESTION))
            n = max((length - fixed) // unit, 0)
            while True:
                before = round(depth * n)
                ids = tokenizer.encode(HEADER + FILLER * before + needle(passkey)
                                       + FILLER * (n - before) + QUESTION)
                if len(ids) <= length or n == 0:
                    break
                n -= 1
            digits = tokenizer.encode(str(passkey), add_special_tokens=False)
            at = _find(ids, digits)
            lo = lay.layout(len(ids) + 1)
            region = ("initial" if at + len(digits) <= lo.init_end
                      else "local" if at >= lo.local_start else "middle")
            cases.append(PasskeyCase(length, depth, passkey, ids, at, region))
    return cases


def _find(ids: list[int], sub: list[int]) -> int:
    for i in range(len(ids) - len(sub) + 1):
        if ids[i:i + len(sub)] == sub:
            return i
    raise ValueError(f"the passkey's tokens {sub} are not in the prompt as a run of tokens")


def answer_of(text: str) -> str | None:
    """The first run of digits in a generated answer."""
    m = re.search(r"\d+", text)
    return m.group() if m else None


@dataclass
class PasskeyResult:
    text: str
    token_ids: list[int]
    correct: bool


def run_passkey(llm: LLM, cases: Sequence[PasskeyCase], max_tokens: int) -> list[PasskeyResult]:
    """All cases in one ``generate`` call, deepest needle first (the longest shared prefix
    is computed first and hit by the rest); results in the cases' order."""
    order = sorted(range(len(cases)), key=lambda i: (-cases[i].needle_at, -len(cases[i].token_ids)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": cases[i].token_ids} for i in order], params)
    results: list[PasskeyResult | None] = [None] * len(cases)
    for i, out in zip(order, outs):
        c = out.outputs[0]
        results[i] = PasskeyResult(c.text, list(c.token_ids),
                                   answer_of(c.text) == str(cases[i].passkey))
    return results  # type: ignore[return-value]


# ---- teacher forcing -----------------------------------------------------------------
@dataclass
class ForcedStep:
    """One sampled row under forcing: the row predicting ``text[position]`` in the window
    whose prompt is ``text[:start]``."""

    start: int
    position: int
    argmax: int       # the model's greedy choice
    target: int       # the text's token, fed back instead
    logits: torch.Tensor | None = None


class ForcingSampler:
    """Stands in for the runner's sampler: records each row's argmax (what greedy
    sampling picks) and returns the text's true next token instead, so every decode step
    follows the text. A row is placed in the text by its prompt length (a window's start)
    and its output so far."""

    def __init__(self, inner: Sampler, text: Sequence[int], keep_logits: bool = False) -> None:
        self.inner = inner
        self.text = list(text)
        self.keep_logits = keep_logits
        self.steps: list[ForcedStep] = []

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        vocab = self.inner.vocab_size
        argmax = logits[:, :vocab].argmax(dim=-1).tolist()
        targets = []
        for i, row in enumerate(rows):
            start = len(row.prompt_token_ids)
            pos = start + len(row.output_token_ids)
            out = row.output_token_ids
            if (pos >= len(self.text) or row.prompt_token_ids[-1] != self.text[start - 1]
                    or (len(out) and out[-1] != self.text[pos - 1])):
                raise RuntimeError(f"a sampled row (prompt {start} tokens, output "
                                   f"{len(row.output_token_ids)}) does not follow the text")
            targets.append(self.text[pos])
            self.steps.append(ForcedStep(
                start, pos, argmax[i], self.text[pos],
                logits[i, :vocab].float().cpu().clone() if self.keep_logits else None))
        return SamplerOutput(targets, [None] * len(rows))


def window_starts(prefill: int, tokens: int, steps: int, windows: int) -> list[int]:
    """``windows`` starts spread evenly from ``prefill`` to ``tokens - steps``."""
    last = tokens - steps
    if windows < 1 or not 0 < prefill <= last:
        raise ValueError(f"need windows >= 1 and 0 < prefill ({prefill}) <= tokens - steps "
                         f"({last})")
    if windows == 1:
        return [prefill]
    return sorted({prefill + round(i * (last - prefill) / (windows - 1)) for i in range(windows)})


def run_forced(llm: LLM, text: Sequence[int], starts: Sequence[int], steps: int,
               keep_logits: bool = False) -> list[ForcedStep]:
    """Each window ``text[:start]`` prefilled, then ``steps`` tokens forced to the text, all
    windows in one ``generate`` call (longest first: the shorter prompts are its prefix
    and hit the prefix cache). Raises if any output differs from the text."""
    runner = llm.engine.runner
    sampler = ForcingSampler(runner.sampler, text, keep_logits)
    runner.sampler = sampler
    order = sorted(starts, reverse=True)
    try:
        outs = llm.generate([{"prompt_token_ids": list(text[:s])} for s in order],
                            SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    finally:
        runner.sampler = sampler.inner
    for s, out in zip(order, outs):
        if list(out.outputs[0].token_ids) != list(text[s:s + steps]):
            raise RuntimeError(f"window at {s}: the forced output is not the text")
    return sorted(sampler.steps, key=lambda st: (st.start, st.position))


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


# ---- the run -------------------------------------------------------------------------
@dataclass
class Workload:
    cases: list[PasskeyCase]
    answer_tokens: int
    text: list[int]
    text_source: str
    starts: list[int]
    steps: int


@dataclass
class VariantRun:
    variant: str
    load_s: float = 0.0
    passkey_s: float = 0.0
    forced_s: float = 0.0
    passkey: list[PasskeyResult] = field(default_factory=list)
    forced: list[ForcedStep] = field(default_factory=list)
    tier_stats: dict[str, int] = field(default_factory=dict)


def run_variant(llm: LLM, variant: str, work: Workload, keep_logits: bool = True) -> VariantRun:
    """The passkey cases, then the forced windows, on one variant's engine."""
    run = VariantRun(variant)
    if work.cases:
        t = time.perf_counter()
        run.passkey = run_passkey(llm, work.cases, work.answer_tokens)
        run.passkey_s = time.perf_counter() - t
        print(f"  {variant}: passkey {sum(r.correct for r in run.passkey)}/{len(work.cases)} "
              f"in {run.passkey_s:.0f} s", flush=True)
    if work.steps:
        t = time.perf_counter()
        run.forced = run_forced(llm, work.text, work.starts, work.steps, keep_logits)
        run.forced_s = time.perf_counter() - t
        print(f"  {variant}: {len(run.forced)} forced rows in {run.forced_s:.0f} s", flush=True)
    lc = llm.engine.runner.long_context
    if lc is not None:
        run.tier_stats = asdict(lc.stats)
    return run


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
    p.add_argument("--windows", type=int, default=4,
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
