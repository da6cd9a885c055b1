"""Block scores against logits computed key by key: the mean summary scores the mean
logit, the min/max bound is at least every key's logit and, when one key takes each
channel's extreme, that key's logit (both within the int8 scoring rows' rounding), hybrid
is their sum, and pool summaries combine into exactly the summary of a retrieval
block's keys."""

import pytest
import torch

from kvcache.block_summary import (
    ExactSelector,
    combine,
    row_vectors,
    score,
    scoring_rows,
    summarize,
)
from kvcache.long_context import SUMMARY_KINDS

M, BS, KVH, G, D = 6, 8, 2, 3, 16


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, BS, KVH, D, generator=g), torch.randn(KVH * G, D, generator=g)


def _logits(keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """[KVH, G, M, BS] logits of every query head against every key it reads."""
    return torch.einsum("hgd,mthd->hgmt", query.view(KVH, G, D), keys)


def _step(vectors: torch.Tensor) -> torch.Tensor:
    """The int8 step of each vector [..., D] in a scoring row: its max |value| / 127, as
    an fp16 scale (rounded up by at most 2^-10)."""
    return vectors.abs().amax(-1) / 127 * (1 + 2.0 ** -10)


def _error(query: torch.Tensor, step: torch.Tensor, steps: float) -> torch.Tensor:
    """[KVH, M]: what ``steps`` int8 steps ``step`` [M, KVH] in every channel can move the
    best query head's score: steps * step * sum_d |q_d|."""
    q_abs = query.view(KVH, G, D).abs().sum(-1)                     # [KVH, G]
    return (steps * q_abs[:, :, None] * step.t()[:, None, :]).amax(1) + 1e-5


def test_scores_against_key_by_key_logits():
    """Scores from int8 rows: the mean logit within half a step of the mean key's channels
    (round to nearest), the bound at least every key's logit (rounded outward) and within
    a step of it; hybrid their sum."""
    keys, query = _case()
    counts = torch.full((M,), BS)
    logits = _logits(keys, query)
    mean_err = _error(query, _step(keys.mean(1)), 0.5)
    mean = score(query, scoring_rows(summarize(keys, counts, "mean")), "mean")
    assert ((mean - logits.mean(-1).amax(1)).abs() <= mean_err).all()
    bound = score(query, scoring_rows(summarize(keys, counts, "minmax")), "minmax")
    assert (bound >= logits.amax(-1).amax(1) - 1e-5).all()
    bound_err = _error(query, torch.maximum(_step(keys.amin(1)), _step(keys.amax(1))), 1.0)
    exact_bound = bound_per_head(query, keys).amax(1)
    assert ((bound - exact_bound).abs() <= bound_err).all()
    # A block whose keys all equal one vector: the bound is that key's logit, up to a step.
    same = keys[:, :1].expand(-1, BS, -1, -1)
    same_bound = score(query, scoring_rows(summarize(same, counts, "minmax")), "minmax")
    same_logit = _logits(same, query)[..., 0].amax(1)
    assert (same_bound >= same_logit - 1e-5).all()
    assert (same_bound - same_logit <= _error(query, _step(keys[:, 0]), 1.0)).all()
    # hybrid: the bound plus the mean logit, from int8 rows of lo + mean and hi + mean.
    hybrid = score(query, scoring_rows(summarize(keys, counts, "hybrid")), "hybrid")
    per_head = bound_per_head(query, keys) + logits.mean(-1)
    lo, hi, mean = keys.amin(1), keys.amax(1), keys.mean(1)
    hybrid_err = _error(query, torch.maximum(_step(lo + mean), _step(hi + mean)), 1.0)
    assert ((hybrid - per_head.amax(1)).abs() <= hybrid_err).all()


def test_bounds_round_outward():
    """The stored lo is at most, hi at least, every key's channel, so the bound stays an
    upper bound on each key's logit."""
    keys, query = _case(4)
    rows = scoring_rows(summarize(keys, torch.full((M,), BS), "minmax"))
    lo, hi = row_vectors(rows, "minmax").view(KVH, M, 2, D).unbind(2)
    assert (lo <= keys.amin(1).permute(1, 0, 2)).all()
    assert (hi >= keys.amax(1).permute(1, 0, 2)).all()
    assert (lo < keys.amin(1).permute(1, 0, 2)).any()   # int8 did round some of them
    assert (score(query, rows, "minmax") >= _logits(keys, query).amax(-1).amax(1)).all()


def bound_per_head(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The min/max bound [KVH, G, M] per query head, channel by channel."""
    lo, hi = keys.amin(1), keys.amax(1)                           # [M, KVH, D]
    q = query.view(KVH, G, 1, D)
    return torch.maximum(q * lo.permute(1, 0, 2)[:, None], q * hi.permute(1, 0, 2)[:, None]).sum(-1)


@pytest.mark.parametrize("kind", SUMMARY_KINDS)
def test_pool_summaries_combine_into_the_retrieval_blocks(kind):
    keys, _ = _case(1)
    half = keys.reshape(M * 2, BS // 2, KVH, D)
    pooled = combine(summarize(half, torch.full((M * 2,), BS // 2), kind), 2, kind)
    torch.testing.assert_close(pooled, summarize(keys, torch.full((M,), BS), kind))


@pytest.mark.parametrize("kind", SUMMARY_KINDS)
def test_partial_blocks_ignore_unwritten_rows(kind):
    keys, _ = _case(2)
    counts = torch.tensor([1, 3, 8, 5, 2, 7])
    got = summarize(keys + torch.where(torch.arange(BS)[None, :, None, None]
                                       < counts[:, None, None, None], 0.0, 1e6), counts, kind)
    for i, n in enumerate(counts.tolist()):
        torch.testing.assert_close(got[i], summarize(keys[i:i + 1, :n], torch.tensor([n]),
                                                     kind)[0])


def test_selector_takes_the_best_scored_blocks_in_order():
    keys, query = _case(3)
    summaries = summarize(keys, torch.full((M,), BS), "hybrid")
    chosen, = ExactSelector("hybrid").select(query[None], [scoring_rows(summaries)], [2])
    by_hand = (0.5 * (bound_per_head(query, keys) + _logits(keys, query).mean(-1))).amax(1)
    want = by_hand.topk(2, dim=1).indices.sort(dim=1).values
    assert torch.equal(chosen, want)
