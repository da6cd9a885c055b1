"""Offload mode's copies (``Ops.copy_kv_blocks``): a recall of one KV head of chosen
host-tier blocks into pool blocks, and an offload of whole pool blocks into the host tier,
every row as stored, nothing else touched; the C++ op of the CPU ops and the torch
reference against a block-by-block loop."""

from __future__ import annotations

import pytest
import torch

from kvcache.host_tier import HostKVStore
from kvcache.kv_quant import quantize_rows, row_width
from kvcache.kv_tensors import KVShape
from tests.workers.test_ops import KVH, ORDERS, D, in_pool
from workers.ops import TorchOps
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels

BS, LAYERS, HOST_BLOCKS, POOL_BLOCKS = 16, 3, 40, 30
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def _random_rows(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape[:-1], D, generator=g)
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def _host_tier(dtype: torch.dtype, g: torch.Generator, ops: TorchOps) -> HostKVStore:
    host = HostKVStore(KVShape(LAYERS, BS, KVH, row_width(D, dtype), dtype), HOST_BLOCKS,
                       copy=ops.copy_kv_blocks)
    for layer in range(LAYERS):
        host.kv[layer].copy_(_random_rows(tuple(host.kv[layer].shape), dtype, g))
    return host


@pytest.mark.parametrize("ops", [CpuOps(), TorchOps()], ids=["cpu", "torch"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_recall_copies_one_head_of_each_chosen_block_and_nothing_else(ops, order, dtype):
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    host = _host_tier(dtype, g, ops)
    _, pool = in_pool(_random_rows((2, POOL_BLOCKS, BS, KVH, row_width(D, dtype)), dtype, g),
                      order)
    before = pool.clone()
    src_ids = torch.tensor([7, 0, 39, 12, 7, 25])   # a host block may be recalled twice
    dst_ids = torch.tensor([29, 3, 0, 11, 17, 4])
    head = KVH - 1
    ops.copy_kv_blocks(host.kv[1], src_ids, pool, dst_ids, head)
    want = before.clone()
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
        want[:, d, :, head] = host.kv[1][:, s, :, head]
    assert torch.equal(pool, want)


@pytest.mark.parametrize("ops", [CpuOps(), TorchOps()], ids=["cpu", "torch"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_offload_copies_whole_blocks_of_every_layer_and_nothing_else(ops, order, dtype):
    g = torch.Generator().manual_seed(10 + DTYPES.index(dtype))
    host = _host_tier(dtype, g, ops)
    width = row_width(D, dtype)
    pool = [in_pool(_random_rows((2, POOL_BLOCKS, BS, KVH, width), dtype, g), order)[1]
            for _ in range(LAYERS)]
    before = [layer.clone() for layer in host.kv]
    src_ids, dst_ids = [5, 29, 0, 13], [39, 2, 17, 8]
    host.offload(pool, src_ids, dst_ids)
    for layer in range(LAYERS):
        want = before[layer].clone()
        for s, d in zip(src_ids, dst_ids):
            want[:, d] = pool[layer][:, s]
        assert torch.equal(host.kv[layer], want)


def test_the_cpu_copy_refuses_bad_ids_and_shapes_before_writing_anything():
    assert load_cpu_kernels() is None
    g = torch.Generator().manual_seed(0)
    host = _host_tier(torch.float32, g, CpuOps())
    _, pool = in_pool(_random_rows((2, POOL_BLOCKS, BS, KVH, D), torch.float32, g), ORDERS[0])
    before = pool.clone()
    copy = torch.ops.llm_cluster.copy_kv_blocks
    cases = [
        (torch.tensor([1, 40]), torch.tensor([0, 1]), 0, "source block 40 outside its pool of 40"),
        (torch.tensor([1, 2]), torch.tensor([0, 30]), 0,
         "destination block 30 outside its pool of 30"),
        (torch.tensor([1, 2]), torch.tensor([5, 5]), 0, "destination block 5 given twice"),
        (torch.tensor([1, 2]), torch.tensor([0, 1]), KVH, f"head {KVH} outside the {KVH} KV"),
        (torch.tensor([1]), torch.tensor([0, 1]), 0, "contiguous int64 vectors of one length"),
    ]
    for src_ids, dst_ids, head, message in cases:
        with pytest.raises(RuntimeError, match=message):
            copy(host.kv[1], src_ids, pool, dst_ids, head)
    with pytest.raises(RuntimeError, match="differ in dtype or block shape"):
        copy(host.kv[1].half(), torch.tensor([1]), pool, torch.tensor([0]), 0)
    assert torch.equal(pool, before)
