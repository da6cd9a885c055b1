"""The CPU kernel's block selection (``CpuBlockSelector``) against float64 scores taken
from the summaries' definitions, over the vectors its int8 scoring rows hold: for every
row and KV head it takes a top k (no block it left scores above the lowest it took,
beyond fp32 rounding), ascending; k at or above the block count takes every block in
order; equal scores take the lower block; a NaN query still gets valid blocks. Rows of
different sizes, strided views (as a sequence's summaries are) and each summary kind."""

from __future__ import annotations

import pytest
import torch

from kvcache.block_summary import row_vectors, scoring_rows, scoring_width
from kvcache.long_context import SUMMARY_KINDS
from workers.ops.cpu_kernels import CpuBlockSelector, load_cpu_kernels

pytestmark = pytest.mark.skipif(load_cpu_kernels() is not None,
                                reason="the CPU kernels cannot be built here")

KVH, G, D = 3, 3, 64


def summaries(m: int, kind: str, g: torch.Generator, kvh: int = KVH, d: int = D) -> torch.Tensor:
    """Random summaries [M, S, KVH, D] of ``kind``: bounds with lo <= hi, a mean."""
    a, b = torch.randn(2, m, kvh, d, generator=g)
    vectors = {"mean": [a], "minmax": [torch.minimum(a, b), torch.maximum(a, b)],
               "hybrid": [torch.minimum(a, b), torch.maximum(a, b), (a + b) / 2]}[kind]
    return torch.stack(vectors, dim=1)


def exact_scores(query: torch.Tensor, rows: torch.Tensor, kind: str) -> torch.Tensor:
    """[KVH, M] float64 from the vectors ``rows`` hold (hybrid's lo + mean and hi + mean
    score as a bound does): the best of each KV head's query heads, by definition."""
    kvh, m, _ = rows.shape
    v = row_vectors(rows, kind).double().view(kvh, 1, m, scoring_width(kind), -1)
    q = query.double().view(kvh, -1, 1, v.shape[-1])                # [KVH, G, 1, D]
    if kind == "mean":
        return (q * v[..., 0, :]).sum(-1).amax(1)
    return torch.maximum(q * v[..., 0, :], q * v[..., 1, :]).sum(-1).amax(1)


def strided(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [KVH, M, W] as a view into a longer buffer, as ``SeqTierState`` holds them."""
    buf = torch.full((rows.shape[0], rows.shape[1] + 7, rows.shape[2]), 99, dtype=rows.dtype)
    buf[:, :rows.shape[1]] = rows
    return buf[:, :rows.shape[1]]


# The kernel's vector paths (KV head groups of up to 8; widths in 64s, 16 blocks at a time
# with AVX-512; widths in 8s, where 24 * S leaves a last 8) and its plain loops.
SHAPES = [(KVH, G, D), (2, 8, 128), (2, 4, 24), (1, 9, 20)]


@pytest.mark.parametrize("kvh, group, d", SHAPES)
@pytest.mark.parametrize("kind", SUMMARY_KINDS)
def test_each_row_gets_a_top_k_of_the_exact_scores(kind, kvh, group, d):
    g = torch.Generator().manual_seed(SUMMARY_KINDS.index(kind))
    sizes, ks = [56, 5, 300, 56], [8, 9, 40, 56]
    rows = [scoring_rows(summaries(m, kind, g, kvh, d)) for m in sizes]
    queries = torch.randn(len(sizes), kvh * group, d, generator=g)
    chosen = CpuBlockSelector(kind).select(queries, [strided(r) for r in rows], ks)
    for q, r, k, got in zip(queries, rows, ks, chosen):
        m = r.shape[1]
        assert got.dtype == torch.int64 and got.shape == (kvh, min(k, m))
        if k >= m:
            assert torch.equal(got, torch.arange(m).expand(kvh, -1))
            continue
        exact = exact_scores(q, r, kind)
        for head, picked in enumerate(got):
            assert (picked.diff() > 0).all()
            left = torch.ones(m, dtype=torch.bool)
            left[picked] = False
            assert exact[head, picked].min() >= exact[head, left].max() - 1e-4


def test_equal_scores_take_the_lower_blocks():
    summ = torch.zeros(10, 3, KVH, D)
    summ[6] = 1.0   # one block above the rest, the others tied at 0
    got, = CpuBlockSelector("hybrid").select(torch.ones(1, KVH * G, D), [scoring_rows(summ)], [3])
    assert torch.equal(got, torch.tensor([0, 1, 6]).expand(KVH, -1))


def test_a_nan_query_gets_valid_blocks():
    """NaN scores rank last instead of breaking the partial sort's order."""
    rows = scoring_rows(summaries(40, "hybrid", torch.Generator().manual_seed(7)))
    query = torch.randn(1, KVH * G, D)
    query[0, :G, 5] = float("nan")   # every query head of KV head 0
    got, = CpuBlockSelector("hybrid").select(query, [rows], [6])
    assert got.shape == (KVH, 6) and (got.diff(dim=1) > 0).all()
    assert torch.equal(got[0], torch.arange(6))   # all NaN: the lowest blocks


def test_select_into_writes_each_choice_into_its_rows_tables():
    """``select_into`` chooses what ``select`` chooses for the same query rows (taken from
    a strided q, as a layer's q is a view of its qkv) and writes each head's chosen
    middle blocks into the tables from the row's first column, leaving the rest."""
    g = torch.Generator().manual_seed(7)
    sizes, ks, firsts, per = [40, 6, 70], [8, 9, 5], [2, 0, 4], 2
    rows = [strided(scoring_rows(summaries(m, "hybrid", g))) for m in sizes]
    qkv = torch.randn(4, (KVH * G + 2 * KVH) * D, generator=g)
    q = qkv[:, :KVH * G * D].view(4, KVH * G, D)            # not contiguous
    query_rows = [3, 0, 1]
    middles = [torch.randperm(1000, generator=g)[:m * per].view(m, per) for m in sizes]
    tables = torch.full((4, KVH, 30), -7, dtype=torch.long)
    selector = CpuBlockSelector("hybrid")
    got = selector.select_into(q, query_rows, rows, ks, middles, firsts, tables)
    want = selector.select(q[query_rows], rows, ks)
    expected = torch.full_like(tables, -7)
    for row, sel, mid, first, g_sel in zip(query_rows, want, middles, firsts, got):
        assert torch.equal(g_sel, sel)
        w = sel.shape[1]
        expected[row, :, first:first + w * per] = mid[sel].flatten(1)
    assert torch.equal(tables, expected)
    before = tables.clone()
    with pytest.raises(RuntimeError, match="do not fit the tables"):   # the last row
        selector.select_into(q, [0, 1], rows[1:], [5, 30], middles[1:], [0, 0], tables)
    assert torch.equal(tables, before)   # nothing written, not even the first row's
