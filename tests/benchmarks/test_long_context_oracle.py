"""The oracle's block choice against mass computed by hand."""

import torch

from benchmarks.long_context_oracle import oracle_blocks


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
