"""A prompt's path through the CPU kernels: its context read out of the paged pool
(``gather_kv``) and its causal attention (``prefill_attention``), each against the
torch reference or a float64 softmax written out by hand."""

from __future__ import annotations

import pytest
import torch

from kvcache.kv_quant import dequantize_rows, quantize_rows
from tests.workers.test_ops import KVH, ORDERS, D, in_pool
from workers.ops import TorchOps
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize(("n", "length"), [(1, 1), (7, 7), (16, 16), (70, 70), (33, 200),
                                          (1, 130), (129, 129)])
def test_cpu_prompt_attention_matches_a_float64_causal_softmax(heads, kv_heads, head_dim, n,
                                                               length):
    """The prompt-attention kernel (16 query positions of a GQA group a task, 64-key
    online-softmax blocks) against the softmax written out in float64: lengths inside
    one key block, across blocks, and queries that are only the context's tail."""
    g = torch.Generator().manual_seed(n * 1000 + length)
    q = torch.randn(n, heads, head_dim, generator=g)
    k, v = (torch.randn(length, kv_heads, head_dim, generator=g) for _ in range(2))
    scale = head_dim ** -0.5
    got = CpuOps().causal_attention(q, k, v, scale)
    group = heads // kv_heads
    kf, vf = (x.double().repeat_interleave(group, dim=1) for x in (k, v))   # [L, H, D]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kf) * scale
    visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    want = torch.einsum("hnl,lhd->nhd", probs, vf)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_cpu_prompt_attention_reads_strided_rows_and_rejects_bad_shapes():
    """k and v as the model passes them (slices of the step's [T, KVH, D] rows), and
    shapes the kernel cannot take."""
    assert load_cpu_kernels() is None
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(40, 2, 3, 64, generator=g)          # [T, k/v, KVH, D]: strided rows
    q = torch.randn(40, 6, 64, generator=g)
    got = torch.ops.llm_cluster.prefill_attention(q, kv[:, 0], kv[:, 1], 0.125)
    want = TorchOps().causal_attention(q, kv[:, 0].contiguous(), kv[:, 1].contiguous(), 0.125)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="need n <= L, KVH dividing H"):
        torch.ops.llm_cluster.prefill_attention(q, kv[:20, 0], kv[:20, 1], 0.125)
    with pytest.raises(RuntimeError, match="head size 32"):
        torch.ops.llm_cluster.prefill_attention(q[..., :32].contiguous(),
                                                kv[:, 0, :, :32].contiguous(),
                                                kv[:, 1, :, :32].contiguous(), 0.125)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("length", [1, 16, 45])
def test_cpu_context_read_is_the_reference_read_bit_for_bit(kv_dtype, length, order):
    """Prefill over cached tokens reads its context through ``read_context``: the CPU
    kernel's one pass gives exactly the reference's index copy and conversion, int8 rows
    dequantized value by value (``dequantize_rows``)."""
    g = torch.Generator().manual_seed(length)
    fp = torch.randn(2, 8, 16, KVH, D, generator=g)
    stored = quantize_rows(fp) if kv_dtype == torch.int8 else fp.to(kv_dtype)
    _, cache = in_pool(stored, order)
    table = torch.tensor([6, 1, 3, 7])            # scattered, and longer than the context
    keys, values = CpuOps().read_context(cache, table, length, torch.float32)
    ref_keys, ref_values = TorchOps().read_context(cache, table, length, torch.float32)
    assert keys.shape == (length, KVH, D) and keys.dtype == torch.float32
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    want = stored[1, 6].view(16, KVH, -1)[:min(length, 16)]   # values of the first block
    want = dequantize_rows(want, torch.float32) if kv_dtype == torch.int8 else want.float()
    assert torch.equal(values[:16], want)


def test_cpu_context_read_rejects_a_block_outside_the_pool():
    assert load_cpu_kernels() is None
    cache = torch.zeros(2, 4, 16, KVH, D)
    with pytest.raises(RuntimeError, match="block 4 outside the pool of 4"):
        torch.ops.llm_cluster.gather_kv(cache, torch.tensor([0, 4]), 17)
    with pytest.raises(RuntimeError, match="at least the 2 blocks of 17 tokens"):
        torch.ops.llm_cluster.gather_kv(cache, torch.tensor([0]), 17)
