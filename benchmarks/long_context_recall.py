"""Recall quality of sparse-retrieval attention, on the default model's real attention.

Runs the default model (SmolLM2-135M, 8K window) over about 8K tokens of real English
text (by default the "Compound statements" chapter of Python's language reference, which
ships with every Python as ``pydoc_data.topics``; ``--text FILE`` reads another), records
every layer's post-RoPE queries and keys, and treats each of ``--queries`` positions p
spread over the last ``--span`` tokens as the decode step at context p+1, laid out with
scaled-down regions (64 initial + 512 local tokens, 32-token retrieval blocks, 20% of the
middle). Per layer and KV head it measures the share of the exact attention mass
(softmax with the model's scale, averaged over the group's query heads) held by the
tokens a step attends to when its middle blocks are

- selected: ``ExactSelector``'s top-k over the block summaries, for each summary kind;
- oracle: the k blocks holding the most true mass, the best any selection can do;
- random: k blocks drawn at random (fixed seed);
- or none: the initial and local tokens alone.

The target (issue #13): selected ÷ oracle at least 0.95 on average.

    python -m cluster bench long-context-recall [--tokens 8000] [--queries 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.common import NUM_THREADS
from kvcache.block_summary import ExactSelector, combine, scoring_rows, summarize
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from kvcache.long_context import SUMMARY_KINDS, LongContextConfig
from workers.device import DEFAULT_BLOCK_SIZE
from workers.loading import Checkpoint, load_checkpoint
from workers.models.decoder import DecoderLM
from workers.ops.base import AttentionMetadata, PrefillSegment
from workers.ops.torch_ref import TorchOps

DEFAULT_TOPIC = "compound"
TARGET = 0.95


@dataclass
class Capture:
    """Every layer's rotated queries at the probed positions and keys at all positions."""

    queries: torch.Tensor   # [L, P, H, D] fp32
    keys: torch.Tensor      # [L, T, KVH, D] fp32
    positions: list[int]    # the P probed positions, ascending
    scale: float


class _Recorder:
    """The reference ops, recording what each layer's attention receives: the queries
    and keys after RoPE, the vectors sparse retrieval scores and summarizes."""

    def __init__(self, positions: list[int]) -> None:
        self.ops = TorchOps()
        self.rows = torch.tensor(positions)
        self.queries: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.queries.append(q[self.rows].float())
        self.keys.append(k.float())
        return self.ops.attention(q, k, v, kv_cache, meta, scale)


def capture(checkpoint: Checkpoint, token_ids: list[int], positions: list[int],
            block_size: int) -> Capture:
    """One prefill of ``token_ids`` through our decoder on a paged pool, recorded."""
    cfg, n = checkpoint.config, len(token_ids)
    recorder = _Recorder(positions)
    model = DecoderLM(cfg, checkpoint.weights, recorder, n, torch.device("cpu"), torch.float32)
    num_blocks = -(-n // block_size)
    shape = KVShape(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv_caches = allocate_kv_cache(shape, num_blocks, torch.device("cpu"))
    meta = AttentionMetadata(torch.arange(n), 0, torch.zeros((0, 0), dtype=torch.int64),
                             torch.zeros(0, dtype=torch.int64),
                             [PrefillSegment(0, n, n, torch.arange(num_blocks))], block_size)
    model.forward(torch.tensor(token_ids), torch.arange(n), kv_caches, meta)
    return Capture(torch.stack(recorder.queries), torch.stack(recorder.keys), positions,
                   model.scale)


def retrieval_summaries(keys: torch.Tensor, kind: str, block_size: int,
                        retrieval_block_size: int) -> torch.Tensor:
    """Summaries [M, S, KVH, D] of the whole retrieval blocks of ``keys`` [T, KVH, D],
    built as a worker builds them (per pool block, then combined); checked against the
    summaries of the retrieval blocks' keys taken directly."""
    m = keys.shape[0] // retrieval_block_size
    per_block = retrieval_block_size // block_size

    def of(size: int) -> torch.Tensor:
        blocks = keys[:m * retrieval_block_size].reshape(-1, size, *keys.shape[1:])
        return summarize(blocks, torch.full((blocks.shape[0],), size), kind)

    pooled = combine(of(block_size), per_block, kind)
    torch.testing.assert_close(pooled, of(retrieval_block_size))
    return pooled


def _captured(base: torch.Tensor, middle: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Mass [KVH] of the initial and local tokens plus the ``chosen`` [KVH, k] middle blocks
    (ascending, so equal choices sum in the same order)."""
    return base + middle.gather(1, chosen).sum(1)


def recall(cap: Capture, config: LongContextConfig, kinds: Sequence[str], block_size: int,
           seed: int = 0) -> dict[str, torch.Tensor]:
    """Captured attention mass [P, L, KVH] per method: ``init+local``, ``random``,
    ``oracle`` and ``selected/<kind>`` for each summary kind."""
    config.check_block_size(block_size)
    rb = config.retrieval_block_size
    num_layers, _, heads, _ = cap.queries.shape
    kvh = cap.keys.shape[2]
    rows = {kind: [scoring_rows(retrieval_summaries(cap.keys[layer], kind, block_size, rb))
                   for layer in range(num_layers)] for kind in kinds}
    selectors = {kind: ExactSelector(kind) for kind in kinds}
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {}
    for i, p in enumerate(cap.positions):
        lay = config.layout(p + 1)
        first, m, k = lay.first_middle, lay.num_middle, lay.top_k
        # Query head h reads KV head h // G, as in the attention op.
        q = cap.queries[:, i].reshape(num_layers, kvh, heads // kvh, -1)
        logits = torch.einsum("lkgd,lnkd->lkgn", q, cap.keys[:, :p + 1]) * cap.scale
        probs = torch.softmax(logits, dim=-1).mean(2)                     # [L, KVH, p+1]
        middle = probs[..., lay.init_end:lay.local_start].reshape(num_layers, kvh, m, rb).sum(-1)
        base = probs[..., :lay.init_end].sum(-1) + probs[..., lay.local_start:].sum(-1)
        step: dict[str, list[torch.Tensor]] = {}
        for layer in range(num_layers):
            b, mid = base[layer], middle[layer]
            chosen = {"oracle": mid.topk(k, dim=1).indices,
                      "random": torch.rand(kvh, m, generator=gen).argsort(1)[:, :k]}
            for kind in kinds:
                chosen[f"selected/{kind}"] = selectors[kind].select(
                    cap.queries[layer, i][None], [rows[kind][layer][:, first:first + m]], [k])[0]
            step.setdefault("init+local", []).append(b)
            for name, idx in chosen.items():
                step.setdefault(name, []).append(_captured(b, mid, idx.sort(dim=1).values))
        for name, masses in step.items():
            out.setdefault(name, []).append(torch.stack(masses))
    return {name: torch.stack(masses) for name, masses in out.items()}


def figures(masses: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Mean, 10th percentile and minimum over every (position, layer, KV head) of each
    method's mass and of its ratio to the oracle's mass at the same step."""
    out = {}
    for name, mass in masses.items():
        ratio = mass / masses["oracle"]
        out[name] = {f"{prefix}{stat}": float(fn(x.flatten()))
                     for prefix, x in (("", mass), ("of_oracle_", ratio))
                     for stat, fn in (("mean", torch.mean),
                                      ("p10", lambda t: torch.quantile(t, 0.1)),
                                      ("min", torch.min))}
    return out


def per_layer(masses: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Each method's mean ratio to the oracle per layer (the oracle's own: its mass)."""
    oracle = masses["oracle"]
    return {name: (oracle if name == "oracle" else mass / oracle).mean((0, 2)).tolist()
            for name, mass in masses.items()}


def read_text(path: str | None) -> tuple[str, str]:
    """The text to run and a line saying where it came from."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8"), path
    import pydoc_data.topics as topics

    return (topics.topics[DEFAULT_TOPIC], f"{topics.__file__}, topic {DEFAULT_TOPIC!r} "
            f"(Python {platform.python_version()}'s language reference)")


def _table(figs: dict[str, dict[str, float]]) -> str:
    rows = ["| method | mass mean | p10 | min | ÷ oracle mean | p10 | min |",
            "|---|---|---|---|---|---|---|"]
    for name, f in figs.items():
        rows.append(f"| {name} | {f['mean']:.3f} | {f['p10']:.3f} | {f['min']:.3f} | "
                    f"{f['of_oracle_mean']:.3f} | {f['of_oracle_p10']:.3f} | "
                    f"{f['of_oracle_min']:.3f} |")
    return "\n".join(rows)


def _layer_table(layers: dict[str, list[float]]) -> str:
    names = list(layers)
    heads = ("oracle mass" if n == "oracle" else f"{n} ÷ oracle" for n in names)
    rows = ["| layer | " + " | ".join(heads) + " |", "|---" * (len(names) + 1) + "|"]
    for i in range(len(layers["oracle"])):
        rows.append(f"| {i} | " + " | ".join(f"{layers[n][i]:.3f}" for n in names) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m benchmarks.long_context_recall") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--text", metavar="FILE",
                   help="a UTF-8 text file (default: Python's own language reference)")
    p.add_argument("--tokens", type=int, default=8000, help="tokens of the text to run")
    p.add_argument("--queries", type=int, default=64, help="decode steps probed")
    p.add_argument("--span", type=int, default=2048,
                   help="the probed steps are spread over the last SPAN tokens")
    p.add_argument("--initial", type=int, default=64, help="initial tokens, always attended")
    p.add_argument("--local", type=int, default=512, help="local tokens, always attended")
    p.add_argument("--retrieval-block", type=int, default=32, help="tokens per retrieval block")
    p.add_argument("--top-k-percent", type=float, default=0.2,
                   help="share of the middle blocks attended")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    checkpoint = load_checkpoint(None)
    window = checkpoint.config.max_position_embeddings
    if not 0 < args.span <= args.tokens <= window:
        p.error(f"need 0 < --span ({args.span}) <= --tokens ({args.tokens}) <= the model's "
                f"window ({window})")
    text, source = read_text(args.text)
    ids = checkpoint.tokenizer.encode(text)
    if len(ids) < args.tokens:
        p.error(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    ids = ids[:args.tokens]
    positions = torch.linspace(args.tokens - args.span, args.tokens - 1, args.queries)
    positions = positions.round().long().unique().tolist()
    # Every probed step is past the dense boundary: sparse.
    config = LongContextConfig(enabled=True, initial_tokens=args.initial,
                               local_tokens=args.local, retrieval_block_size=args.retrieval_block,
                               top_k_percent=args.top_k_percent, dense_boundary=positions[0] + 1)
    block_size = DEFAULT_BLOCK_SIZE["cpu"]
    first, last = config.layout(positions[0] + 1), config.layout(positions[-1] + 1)
    print(f"text: {source}\nmodel: {checkpoint.path}\n{len(ids)} tokens; {len(positions)} "
          f"decode steps at contexts {positions[0] + 1}..{positions[-1] + 1}; "
          f"{args.initial} initial + {args.local} local tokens, {args.retrieval_block}-token "
          f"blocks ({block_size}-token pool blocks), top {first.top_k}..{last.top_k} of "
          f"{first.num_middle}..{last.num_middle} middle blocks", flush=True)
    masses = recall(capture(checkpoint, ids, positions, block_size), config, SUMMARY_KINDS,
                    block_size, args.seed)
    figs, layers = figures(masses), per_layer(masses)
    print(f"\nAttention mass captured, over {len(positions)} steps x layers x KV heads:\n"
          + _table(figs) + "\n\nPer layer (mean):\n" + _layer_table(layers) + "\n")
    for kind in SUMMARY_KINDS:
        share = figs[f"selected/{kind}"]["of_oracle_mean"]
        print(f"{kind}: {share:.3f} of the oracle's mass on average: "
              f"{'meets' if share >= TARGET else 'misses'} the {TARGET} target")
    best = max(SUMMARY_KINDS, key=lambda kind: figs[f"selected/{kind}"]["of_oracle_mean"])
    print(f"better summary: {best}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "text": source, "model": checkpoint.path,
            "tokens": len(ids), "positions": positions, "block_size": block_size,
            "config": asdict(config), "figures": figs, "per_layer": layers, "best": best,
        }, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
