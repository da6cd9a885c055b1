"""How far selection alone can take teacher-forced agreement: the oracle's ceiling.

The end-quality benchmark (``long_context_quality``) measures how often sparse decode
steps pick dense's next token. This one asks what any block summary could reach at the
same budget: it runs the same forced windows with the sparse variant's selection replaced
by the oracle's, the k middle blocks holding the most true attention mass (softmax of
the real keys, summed over the GQA group's query heads), read from the device pool. The
oracle needs every key on the device, so it runs in sparse mode; the rest of the step
(tables, attention op) is the engine's own.

``--key-bits`` adds oracles that compute the mass from keys rounded to fewer bits per
channel (a scale per token and KV head): what a summary holding every token's key at
that precision would select, and so what such a summary kind could reach.

``--top-k-percent`` takes several shares of the middle: each gets its own summary and
oracle runs, against one dense run, and ``--plot`` draws agreement against the share.

    python -m cluster bench long-context-oracle [--top-k-percent 0.2,0.4] [--key-bits 4,3]
        [--json PATH] [--plot PNG]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.long_context_quality import AGREEMENT_TARGET, forced_figures
from benchmarks.long_context_recall import read_text
from benchmarks.long_context_tasks import (
    WINDOWS,
    ForcedStep,
    Regions,
    engine_config,
    run_forced,
    window_starts,
)
from benchmarks.peers.common import NUM_THREADS
from cluster.llm import LLM
from workers.ops.base import AttentionMetadata
from workers.sparse_step import SparseStep


def round_keys(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """``keys`` [..., D] rounded to ``bits``-bit symmetric integers with a scale per row
    (its largest magnitude over 2^(bits-1) - 1), returned dequantized in fp32."""
    levels = 2 ** (bits - 1) - 1
    k = keys.float()
    scale = k.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / levels
    return (k / scale).round().clamp(-levels, levels) * scale


def oracle_blocks(q: torch.Tensor, keys: torch.Tensor, k: int,
                  key_bits: int | None = None) -> torch.Tensor:
    """[KVH, k] ascending indices of the middle blocks ``keys`` [M, T, KVH, D] that hold the
    most attention mass of the query heads ``q`` [H, D], summed over each GQA group; with
    ``key_bits``, the mass of the keys rounded by ``round_keys``."""
    if key_bits is not None:
        keys = round_keys(keys, key_bits)
    m, _, kvh, d = keys.shape
    logits = torch.einsum("hgd,mthd->hgmt", q.float().view(kvh, -1, d), keys.float())
    mass = torch.softmax(logits.flatten(2) / math.sqrt(d), -1).view_as(logits).sum((1, 3))
    return mass.topk(min(k, m), dim=1).indices.sort(dim=1).values


def _oracle_decode_meta(key_bits: int | None) -> Callable[..., AttentionMetadata]:
    """``SparseStep.decode_meta`` with the oracle's choice in every sparse row."""

    def decode_meta(self: SparseStep, layer: int, q: torch.Tensor,
                    kv_cache: torch.Tensor) -> AttentionMetadata:
        tables = self.meta.decode_head_tables
        for sr in self.rows:
            m, r = sr.middle.shape
            keys = kv_cache[0][sr.middle.flatten()]                  # [M*r, bs, KVH, D]
            keys = keys.reshape(m, -1, *keys.shape[2:])
            chosen = oracle_blocks(q[sr.row], keys, sr.top_k, key_bits)
            picked = sr.middle[chosen].flatten(1)
            tables[sr.row, :, sr.first:sr.first + picked.shape[1]] = picked
        return self.meta

    return decode_meta


@contextmanager
def oracle_selection(key_bits: int | None = None) -> Iterator[None]:
    """Sparse steps select by the oracle (over keys rounded to ``key_bits``) while
    inside."""
    saved = SparseStep.decode_meta
    SparseStep.decode_meta = _oracle_decode_meta(key_bits)
    try:
        yield
    finally:
        SparseStep.decode_meta = saved


def shares(text: str) -> list[float]:
    """``--top-k-percent``: comma-separated shares of the middle, each in (0, 1]."""
    try:
        got = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        got = []
    if not got or not all(0 < x <= 1 for x in got):
        raise SystemExit(f"--top-k-percent: got {text!r}; expected comma-separated shares "
                         "of the middle in (0, 1], for example 0.2,0.4")
    return sorted(set(got))


def forced_rows(selection: str, regions: Regions, oracles: dict[str, int | None], body: str,
                args: argparse.Namespace, starts: list[int]) -> list[ForcedStep]:
    """One engine's forced rows: ``dense``, the summaries' selection (``summary``), or one
    of ``oracles`` (name -> key bits, None for exact keys)."""
    llm = LLM(config=engine_config("dense" if selection == "dense" else "sparse", regions))
    try:
        text = llm.get_tokenizer().encode(body)[:args.tokens]
        if selection not in oracles:
            return run_forced(llm, text, starts, args.steps, keep_logits=True)
        with oracle_selection(oracles[selection]):
            return run_forced(llm, text, starts, args.steps, keep_logits=True)
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m benchmarks.long_context_oracle") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8000, help="tokens of the text to force")
    p.add_argument("--prefill", type=int, default=2000, help="the first window's prompt")
    p.add_argument("--windows", type=int, default=WINDOWS,
                   help="forced windows (default: %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="forced decode steps per window")
    p.add_argument("--top-k-percent", default=str(Regions.top_k_percent),
                   help="comma-separated shares of the middle blocks attended, each run "
                        "against one dense run (default: %(default)s)")
    p.add_argument("--key-bits", default="",
                   help="comma-separated bit widths: also an oracle over keys rounded to each")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="write agreement against the share attended here")
    args = p.parse_args(argv)
    budgets = shares(args.top_k_percent)
    bits = [b for b in args.key_bits.split(",") if b]
    if not all(b.isdigit() and 2 <= int(b) <= 16 for b in bits):
        raise SystemExit(f"--key-bits: got {args.key_bits!r}; expected comma-separated "
                         "widths from 2 to 16, for example 4,3")
    torch.set_num_threads(NUM_THREADS)
    body, source = read_text(None)
    starts = window_starts(args.prefill, args.tokens, args.steps, args.windows)
    oracles = {"oracle": None} | {f"oracle, {b}-bit keys": int(b) for b in bits}
    dense = forced_rows("dense", Regions(), oracles, body, args, starts)
    figs: dict[float, dict[str, dict]] = {}
    for share in budgets:
        regions = Regions(top_k_percent=share)
        figs[share] = {name: forced_figures(dense, forced_rows(name, regions, oracles, body,
                                                               args, starts))
                       for name in ("summary", *oracles)}
        print(f"  {share:.0%} of the middle: done", flush=True)
    print(f"text: {source}; windows at {starts}, {args.steps} steps each; "
          f"summary {Regions.summary!r}")
    print("| share of the middle | selection | agreement with dense | differ | KL mean / max "
          "| NLL (dense) |")
    print("|---|---|---|---|---|---|")
    for share, by_name in figs.items():
        for n, f in by_name.items():
            print(f"| {share:.0%} | {n} | {f['agreement']:.4f} | {f['disagreements']} | "
                  f"{f['kl_from_dense_mean']:.4f} / {f['kl_from_dense_max']:.3f} | "
                  f"{f['nll']:.3f} ({f['dense_nll']:.3f}) |")
    for name in ("summary", "oracle"):
        met = [s for s in budgets if figs[s][name]["agreement"] >= AGREEMENT_TARGET]
        print(f"{name}: reaches the {AGREEMENT_TARGET} target "
              + (f"from {met[0]:.0%} of the middle" if met else "at none of these shares"))
    if args.plot:
        from benchmarks.plot import plot_agreement
        plot_agreement(figs, AGREEMENT_TARGET, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"argv": list(argv or []), "starts": starts, "shares": budgets,
             "regions": asdict(Regions()),   # top_k_percent: each of the shares instead
             "forced": {str(s): f for s, f in figs.items()}}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
