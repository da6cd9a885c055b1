"""The oracle's block choice against mass computed by hand."""

import re
import struct

import pytest
import torch

from benchmarks.long_context_oracle import oracle_blocks, round_keys, shares
from benchmarks.plot import plot_agreement


def test_oracle_takes_the_blocks_with_the_most_group_mass():
    # 2 KV heads, 2 query heads each, 4 blocks of 2 keys, D = 2. Query heads read e0 (x10).
    keys = torch.zeros(4, 2, 2, 2)
    q = torch.tensor([[10.0, 0.0]] * 4)
    keys[1, 0, 0] = torch.tensor([1.0, 0.0])   # head 0: block 1 one strong key
    keys[3, :, 0] = torch.tensor([0.6, 0.0])   # head 0: block 3 two medium keys
    keys[2, :, 1] = torch.tensor([0.5, 0.0])   # head 1: block 2
    scale = 2 ** -0.5
    # head 0, by hand: exp(10*scale) = 1176 (block 1) + 1 against 2*exp(6*scale) = 138.8
    assert torch.exp(torch.tensor(10 * scale)) > 2 * torch.exp(torch.tensor(6 * scale))
    got = oracle_blocks(q, keys, 2)
    assert got[0].tolist() == [1, 3]
    assert 2 in got[1].tolist()   # head 1: block 2, then a tie among the others


def test_keys_round_to_a_scale_per_row():
    keys = torch.tensor([[0.7, -0.35, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # 4 bits: 7 levels a side, scale 0.7 / 7 = 0.1; -3.5 rounds to even (-4).
    got = round_keys(keys, 4)
    assert torch.allclose(got[0], torch.tensor([0.7, -0.4, 0.1, 0.0]))
    assert torch.equal(got[1], torch.zeros(4))   # an all-zero row stays zero, not NaN
    # 2 bits: one level a side, so every channel is -max, 0 or +max.
    assert torch.allclose(round_keys(keys, 2)[0], torch.tensor([0.7, -0.0, 0.0, 0.0]))


def test_oracle_over_rounded_keys_chooses_by_the_rounded_mass():
    # One KV head of one query head reading channel 1; D = 2. At 2 bits a row keeps only
    # -max, 0 or +max: block 0's key [1, 0.45] becomes [1, 0] and loses its channel-1
    # logit, while block 1's [0.4, 0.4] is exact.
    keys = torch.zeros(2, 1, 1, 2)
    keys[0, 0, 0] = torch.tensor([1.0, 0.45])
    keys[1, 0, 0] = torch.tensor([0.4, 0.4])
    q = torch.tensor([[0.0, 10.0]])
    assert oracle_blocks(q, keys, 1).tolist() == [[0]]               # 4.5 against 4.0
    assert oracle_blocks(q, keys, 1, key_bits=2).tolist() == [[1]]   # 0 against 4.0
    assert oracle_blocks(q, keys, 1, key_bits=8).tolist() == [[0]]   # 8 bits keep 0.45


def test_shares_of_the_middle_parse_sort_and_refuse_with_the_value():
    assert shares("0.4, 0.2,0.2") == [0.2, 0.4]
    assert shares("1") == [1.0]
    for bad in ("0", "1.5", "0.2,x", ""):
        with pytest.raises(SystemExit, match=re.escape(repr(bad))):
            shares(bad)


def test_agreement_plot_is_a_png_of_the_figure_size(tmp_path):
    figs = {s: {"summary": {"agreement": a}, "oracle": {"agreement": a + 0.02}}
            for s, a in ((0.2, 0.95), (0.4, 0.97))}
    path = tmp_path / "agreement.png"
    plot_agreement(figs, 0.99, path)
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    # IHDR: width and height, 7 x 4.5 inches at 120 dpi
    assert struct.unpack(">II", head[16:24]) == (840, 540)
