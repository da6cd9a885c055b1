"""The two tasks of the long-context end-quality benchmark, and their runs on one engine.

Passkey retrieval (a 5-digit passkey hidden at a depth of the classic filler, answered
greedily) and teacher-forced windows of real text (each decode step's argmax recorded
while the text's true next token is fed instead): the inputs, the engine of each variant
(dense, sparse, offload) and one variant's run over both. ``long_context_quality``
turns two variants' runs into figures; ``long_context_oracle`` reruns the forced windows
with the best selection any summary could make.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from cluster.config import EngineConfig, config_from_dict
from cluster.llm import LLM
from kvcache.long_context import LongContextConfig
from scheduler.protocol import SamplingParams
from workers.sampler import Sampler, SamplerOutput, SamplingRow
from workers.tokenizer import Tokenizer

VARIANTS = ("dense", "sparse", "offload")
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


# Forced windows of 100 steps over 8000 tokens. Four of them flattered every selection,
# the oracle's included (98.99% against 97.5% over eight: benchmarks/RESULTS.md).
WINDOWS = 8


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



# ---- one variant's run ---------------------------------------------------------------
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

