"""Block summaries and top-k block selection for sparse-retrieval attention.

A summary describes one pool block's post-RoPE keys per KV head, so a query can
estimate how much attention the block would get without reading its keys:

- ``mean``: the mean key (the reference design's representation vector); a block scores
  ``q . mean``, the mean of its keys' logits;
- ``minmax``: per-channel lower and upper bounds (Quest); a block scores
  ``sum_d max(q_d * min_d, q_d * max_d)``, an upper bound on any of its keys' logits;
- ``hybrid``: both, scored by the sum of the bound and the mean logit (twice their
  midpoint, which ranks alike). The bound overrates a block whose keys spread widely
  and the mean underrates one with a few strong keys; on the default model's real
  attention their midpoint captures more of the oracle's mass than either, and moves
  the next token less (benchmarks/RESULTS.md).

Summaries are kept per *pool* block, where the KV is written, and combined into
retrieval blocks (``retrieval_block_size`` tokens, several pool blocks) when scored:
a mean of equal-sized blocks' means, a min of mins, a max of maxes, so a retrieval
block's summary is exactly the one its keys would give. The query heads of a GQA
group are combined by taking the best head's score: a block matters if it matters to
any head that reads it.

A sequence's retrieval-block summaries are scored in their *scoring rows* layout
[KVH, M, V * (D + 2)], int8 (``scoring_rows``): every kind's score is then one batched product of
the query's parts (``query_parts``) with the rows' V vectors, which each decode step runs
per layer and sequence. Three products in einsum's layout took as long as the step's
sparse attention itself (benchmarks/RESULTS.md). ``hybrid`` scores from two vectors, not
three: q . mean splits into q's negative and positive parts like the bound, so its rows
hold lo + mean and hi + mean, and a step reads a third fewer bytes for the same score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvcache.kv_quant import dequantize_rows, quantize_rows

_WIDTHS = {"mean": 1, "minmax": 2, "hybrid": 3}
_SCORING_WIDTHS = {"mean": 1, "minmax": 2, "hybrid": 2}


def summary_width(kind: str) -> int:
    """Vectors per (block, KV head): mean; min, max; or min, max, mean for ``hybrid``."""
    return _WIDTHS[kind]


def scoring_width(kind: str) -> int:
    """Vectors per (block, KV head) of a scoring row: mean; lo, hi; or lo + mean,
    hi + mean for ``hybrid``."""
    return _SCORING_WIDTHS[kind]


def summarize(keys: torch.Tensor, counts: torch.Tensor, kind: str) -> torch.Tensor:
    """Summaries [n, S, KVH, D] (fp32) of ``keys`` [n, block_size, KVH, D], of which each
    block's first ``counts[i]`` rows are written (the rest are ignored); int8 keys (rows
    of D + 2, ``kv_quant``) are summarized dequantized."""
    if kind == "hybrid":
        return torch.cat((summarize(keys, counts, "minmax"), summarize(keys, counts, "mean")),
                         dim=1)
    n, bs = keys.shape[:2]
    k = dequantize_rows(keys, torch.float32) if keys.dtype == torch.int8 else keys.float()
    valid = (torch.arange(bs, device=keys.device)[None, :] < counts[:, None])[..., None, None]
    if kind == "mean":
        total = torch.where(valid, k, 0.0).sum(1)
        return (total / counts.clamp(min=1)[:, None, None].to(k.dtype)).unsqueeze(1)
    lo = torch.where(valid, k, float("inf")).amin(1)
    hi = torch.where(valid, k, float("-inf")).amax(1)
    return torch.stack((lo, hi), dim=1)


def combine(pool_summaries: torch.Tensor, per_block: int, kind: str) -> torch.Tensor:
    """Retrieval-block summaries [..., M, S, KVH, D] from the summaries of their full pool
    blocks [..., M * per_block, S, KVH, D], in order (any leading dims, e.g. layers)."""
    if per_block == 1:
        return pool_summaries
    if kind == "hybrid":
        return torch.cat((combine(pool_summaries[..., :2, :, :], per_block, "minmax"),
                          combine(pool_summaries[..., 2:, :, :], per_block, "mean")), dim=-3)
    *lead, n, s, kvh, d = pool_summaries.shape
    grouped = pool_summaries.reshape(*lead, n // per_block, per_block, s, kvh, d)
    if kind == "mean":
        return grouped.mean(-4)
    return torch.stack((grouped[..., 0, :, :].amin(-3), grouped[..., 1, :, :].amax(-3)),
                       dim=-3)


def scoring_rows(summaries: torch.Tensor) -> torch.Tensor:
    """Summaries [..., M, S, KVH, D] (the kind by S: mean 1, minmax 2, hybrid 3) as
    ``score`` reads them: [..., KVH, M, V * (D + 2)] int8 with V = ``scoring_width``, each
    vector a ``kv_quant`` row (its D values, then its fp16 scale).

    A decode step reads every middle block's row in every layer, and at a small budget
    those reads cost as much as attending the selected tokens; int8 rows are a quarter of
    fp32's bytes. The bounds round outward (lo down, hi up; for ``hybrid`` lo + mean down,
    hi + mean up), so ``minmax`` still bounds every key's logit; the mean rounds to
    nearest."""
    *lead, m, s, kvh, d = summaries.shape
    vectors = summaries.unbind(-3)
    if s == 3:   # hybrid: lo + mean, hi + mean
        vectors = (vectors[0] + vectors[2], vectors[1] + vectors[2])
    rounding = (torch.floor, torch.ceil) if s > 1 else (torch.round,)
    rows = torch.stack([quantize_rows(v, r) for v, r in zip(vectors, rounding)], dim=-3)
    n, v = len(lead), len(vectors)
    return rows.permute(*range(n), n + 2, n, n + 1, n + 3).reshape(*lead, kvh, m, v * (d + 2))


def row_vectors(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """Scoring rows [..., V * (D + 2)] int8 as the fp32 vectors they hold, [..., V * D]."""
    *lead, width = rows.shape
    s = scoring_width(kind)
    return dequantize_rows(rows.reshape(*lead, s, width // s), torch.float32).reshape(*lead, -1)


def query_parts(query: torch.Tensor, kvh: int, kind: str) -> torch.Tensor:
    """One token's query heads [H, D] as [KVH, G, V * D], matched to a scoring row's
    vectors: ``q`` against the mean; against the bounds (lo, hi), or hybrid's lo + mean
    and hi + mean, its negative and positive parts, since max(q_d * lo_d, q_d * hi_d) is
    q_d * hi_d where q_d > 0, else q_d * lo_d, and q . mean is the sum of the parts'."""
    q = query.float().view(kvh, -1, query.shape[-1])
    if kind == "mean":
        return q
    return torch.cat((q.clamp(max=0), q.clamp(min=0)), dim=-1)


def score(query: torch.Tensor, rows: torch.Tensor, kind: str) -> torch.Tensor:
    """Scores [KVH, M] of retrieval blocks (``rows`` [KVH, M, V * (D + 2)], ``scoring_rows``)
    for one token's query heads ``query`` [H, D]; higher means more attention expected."""
    parts = query_parts(query, rows.shape[0], kind)
    return torch.bmm(parts, row_vectors(rows, kind).transpose(1, 2)).amax(1)


class BlockSelector(Protocol):
    """Chooses the middle blocks a decode step attends to, for all of one layer's sparse
    rows at once. The default scores every block exactly (``ExactSelector``, and a
    device's kernel for it: ``Ops.block_selector``); an external vector index can stand
    in behind the same call."""

    def select(self, queries: torch.Tensor, rows: Sequence[torch.Tensor],
               ks: Sequence[int]) -> list[torch.Tensor]:
        """Per row i: indices [KVH, min(ks[i], M_i)] (ascending per head) into the M_i
        blocks of ``rows[i]`` [KVH, M_i, V * (D + 2)] (``scoring_rows``), for the query heads
        ``queries[i]`` [H, D]."""
        ...


class ExactSelector:
    """Top-k over the scores of every candidate block, in torch on any device."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def select(self, queries: torch.Tensor, rows: Sequence[torch.Tensor],
               ks: Sequence[int]) -> list[torch.Tensor]:
        return [_top_k(score(q, r, self.kind), k) for q, r, k in zip(queries, rows, ks)]


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [KVH, k] of each head's k best scores [KVH, M], ascending."""
    if k >= scores.shape[1]:
        idx = torch.arange(scores.shape[1], device=scores.device)
        return idx.expand(scores.shape[0], -1)
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
