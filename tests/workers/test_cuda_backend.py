"""The CUDA attention paths on CPU tensors: SDPA (selected explicitly), and the
FlashAttention path's calls through a stand-in ``flash_attn_with_kvcache`` computed from
its documented definition. Neither needs a GPU; CUDA graphs and the real kernel do."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_npu_backend import D, H, paged_case
from workers.ops import TorchOps, get_ops
from workers.ops.cuda import CudaOps
from workers.ops.quant_linear import quantize_weight


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn 2's paged call on CPU: q [B, Sq, H, D], pages (num_blocks, page, KVH, D),
    int32 block_table and cache_seqlens, causal aligned to the end of the context."""
    calls.append((tuple(q.shape), block_table.dtype, cache_seqlens.dtype, causal))
    assert k is None and v is None and block_table.dtype == cache_seqlens.dtype == torch.int32
    b, sq, h, d = q.shape
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(cache_seqlens[i])
        blocks = block_table[i, :-(-n // page)].long()
        keys = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n].float()
        values = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n].float()
        group = h // keys.shape[1]
        scores = torch.einsum("shd,lhd->hsl", q[i].float(), keys.repeat_interleave(group, 1))
        rows = torch.arange(sq)[:, None] + (n - sq)
        scores = scores * softmax_scale + torch.zeros(sq, n).masked_fill_(
            torch.arange(n)[None, :] > rows, float("-inf"))
        out[i] = torch.einsum("hsl,lhd->shd", scores.softmax(-1),
                              values.repeat_interleave(group, 1)).to(q.dtype)
    return out


calls: list = []


@pytest.mark.parametrize("block_size", [16, 256])
def test_sdpa_path_matches_the_reference(block_size):
    ops = get_ops(torch.device("cpu"), "cuda")
    assert isinstance(ops, CudaOps) and ops.name == "cuda"
    ops.flash = None                       # whatever this machine has installed
    q, k, v, cache, meta = paged_case(block_size, torch.float32)
    want = TorchOps().attention(q, k, v, cache, meta, D ** -0.5)
    torch.testing.assert_close(ops.attention(q, k, v, cache, meta, D ** -0.5), want,
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_path_calls_the_paged_kernel_on_256_token_pages(block_size):
    calls.clear()
    ops = CudaOps(flash_attn_with_kvcache)
    q, k, v, cache, meta = paged_case(block_size, torch.float32)
    want = TorchOps().attention(q, k, v, cache, meta, D ** -0.5)
    torch.testing.assert_close(ops.attention(q, k, v, cache, meta, D ** -0.5), want,
                               atol=2e-5, rtol=1e-4)
    if block_size % 256:
        assert calls == []                 # FlashAttention 2 pages are multiples of 256
    else:
        assert calls == [((3, 1, H, D), torch.int32, torch.int32, True),
                         ((1, 20, H, D), torch.int32, torch.int32, True),
                         ((1, 9, H, D), torch.int32, torch.int32, True)]


@pytest.mark.parametrize(("rows", "width", "padded"),
                         [(3, 64, 32), (20, 64, 64), (32, 64, 64), (3, 128, 17), (20, 128, 40)])
def test_w8a8_tokens_are_padded_to_a_size_the_int8_product_takes(monkeypatch, rows, width,
                                                                  padded):
    """Zero rows up to the size ``int_mm_rows`` gives (the x holds 2 x rows tokens); the
    real rows' results equal the unpadded product's bit for bit."""
    sizes: list[int] = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (sizes.append(a.shape[0]), int_mm(a, b))[1])
    g = torch.Generator().manual_seed(rows)
    w = quantize_weight(torch.randn(24, width, generator=g), "w8a8")
    x, bias = torch.randn(2, rows, width, generator=g), torch.randn(24, generator=g)
    got = CudaOps(None).int8_linear(x, w, bias)
    assert sizes == [padded]
    assert torch.equal(got, TorchOps().int8_linear(x, w, bias))
