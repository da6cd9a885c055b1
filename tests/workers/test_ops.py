"""Ops (the torch reference and the compiled CPU kernels) against a dense,
loop-by-hand oracle on random paged layouts."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.kv_quant import dequantize_rows, quantize_rows
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from workers.ops import AttentionMetadata, PrefillSegment, TorchOps
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels, onednn_linear_problem
from workers.ops.linear_choice import LinearChooser

KVH, H, D = 2, 6, 16
ORDERS = ["layer-major", "block-major"]   # kv_tensors' pool orders


def dense_attention(q, keys, values, scale):
    """q [n, H, D] at the last n positions of keys/values [L, KVH, D], by hand."""
    n, length = q.shape[0], keys.shape[0]
    group = H // KVH
    out = torch.empty_like(q)
    for i in range(n):
        visible = length - n + i + 1
        for h in range(H):
            k = keys[:visible, h // group]
            w = torch.softmax((k @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ values[:visible, h // group]
    return out


def all_ops():
    """Every ops implementation this machine can run; the CPU kernels must build here."""
    problem = load_cpu_kernels()
    assert problem is None, f"CPU kernels failed to build: {problem}"
    return [TorchOps(), CpuOps(LinearChooser())]   # no store: shapes are timed here


def in_pool(cache: torch.Tensor, order: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A 3-layer pool in ``order`` whose middle layer holds ``cache`` [2, blocks, ...] (the
    others zero), and that layer: block-major, its blocks lie a block of every layer apart."""
    _, blocks, bs, kvh, width = cache.shape
    pool = allocate_kv_cache(KVShape(3, bs, kvh, width, cache.dtype), blocks,
                             torch.device("cpu"), block_major=order == "block-major")
    pool[1].copy_(cache)
    return pool, pool[1]


def scatter_sequences(lengths, block_size, num_blocks, seed, dtype=torch.float32):
    """Random contexts written into randomly chosen, non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, KVH, D, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, contexts = [], []
    for length in lengths:
        nb = math.ceil(length / block_size)
        table = torch.tensor([free.pop() for _ in range(nb)])
        flat = cache[:, table].reshape(2, nb * block_size, KVH, D)[:, :length].float()
        tables.append(table)
        contexts.append((flat[0].clone(), flat[1].clone()))
    return cache, tables, contexts


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
@pytest.mark.parametrize(("block_size", "kv_dtype"), [
    (16, torch.float32), (32, torch.float32), (256, torch.float32),
    (16, torch.float16), (32, torch.bfloat16)])
def test_paged_decode_and_prefill_match_dense(ops, block_size, kv_dtype, order):
    scale = D ** -0.5
    decode_lens, prefill = [1, 37, 300], [(20, 20), (9, 130)]  # (query_len, context_len)
    cache, tables, ctx = scatter_sequences(decode_lens + [c for _, c in prefill], block_size,
                                           num_blocks=64, seed=block_size, dtype=kv_dtype)
    _, cache = in_pool(cache, order)
    g = torch.Generator().manual_seed(1)
    n_tokens = len(decode_lens) + sum(q for q, _ in prefill)
    q = torch.randn(n_tokens, H, D, generator=g)
    k = torch.empty(n_tokens, KVH, D)
    v = torch.empty(n_tokens, KVH, D)
    width = max(len(t) for t in tables[:3])
    dec_tables = torch.zeros(3, width, dtype=torch.long)
    for i in range(3):
        dec_tables[i, :len(tables[i])] = tables[i]
        k[i], v[i] = ctx[i][0][-1], ctx[i][1][-1]
    segments, start = [], 3
    for j, (ql, cl) in enumerate(prefill):
        keys, values = ctx[3 + j]
        k[start:start + ql], v[start:start + ql] = keys[cl - ql:], values[cl - ql:]
        segments.append(PrefillSegment(start, ql, cl, tables[3 + j]))
        start += ql
    meta = AttentionMetadata(torch.zeros(n_tokens, dtype=torch.long), 3, dec_tables,
                             torch.tensor(decode_lens), segments, block_size)
    got = ops.attention(q, k, v, cache, meta, scale)
    for i in range(3):
        want = dense_attention(q[i:i + 1], ctx[i][0], ctx[i][1], scale)
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)
    for seg, (keys, values) in zip(segments, ctx[3:]):
        s, n = seg.query_start, seg.query_len
        want = dense_attention(q[s:s + n], keys, values, scale)
        torch.testing.assert_close(got[s:s + n], want, atol=1e-5, rtol=1e-5)


SPARSE_LAYOUTS = [(bs, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)
                  for bs in (16, 32)]


def gathered_attention(q, cache, head_tables, head_lens, scale):
    """Decodes q [n, H, D] over, for each KV head, the first head_lens tokens of the blocks
    its head_tables row lists, gathered by hand and computed in float64."""
    group, bs = H // KVH, cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for kh in range(KVH):
            n = int(head_lens[i, kh])
            blocks = head_tables[i, kh, :math.ceil(n / bs)]
            keys = cache[0, blocks, :, kh].reshape(-1, D)[:n].double()
            values = cache[1, blocks, :, kh].reshape(-1, D)[:n].double()
            for h in range(kh * group, (kh + 1) * group):
                out[i, h] = torch.softmax(keys @ q[i, h].double() * scale, dim=0) @ values
    return out


def decode_meta(tables, lens, block_size, head_tables=None, head_lens=None):
    """Decode-only metadata: one token per sequence, dense tables padded to one width."""
    dense = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for i, t in enumerate(tables):
        dense[i, :len(t)] = t
    return AttentionMetadata(torch.zeros(len(tables), dtype=torch.long), len(tables), dense,
                             torch.tensor(lens), [], block_size, head_tables, head_lens)


@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
@pytest.mark.parametrize(("block_size", "kv_dtype"), [*SPARSE_LAYOUTS, (16, torch.int8)])
@pytest.mark.parametrize("lens", [[1, 37, 300], [1, 37, 300, 45, 16]], ids=["3", "5"])
def test_head_tables_of_every_block_give_the_dense_output_exactly(ops, block_size, kv_dtype,
                                                                   lens):
    """Dense decode is per-head decode with one table broadcast over heads: the same
    computation, so a sparse selection that keeps every block changes no bit. With five
    sequences on two threads the CPU kernel reads an int8 dense table's blocks for all KV
    heads in one task, and per-head tables one head a task."""
    stored = torch.float32 if kv_dtype == torch.int8 else kv_dtype
    cache, tables, _ = scatter_sequences(lens, block_size, 64, seed=block_size, dtype=stored)
    cache = quantize_rows(cache) if kv_dtype == torch.int8 else cache
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(2))
    dense = decode_meta(tables, lens, block_size)
    width = dense.decode_block_tables.shape[1]
    head = decode_meta(tables, lens, block_size,
                       dense.decode_block_tables[:, None].expand(-1, KVH, width).contiguous(),
                       dense.decode_seq_lens[:, None].expand(-1, KVH).contiguous())
    unused = torch.empty(len(lens), KVH, D)
    want = ops.attention(q, unused, unused, cache, dense, D ** -0.5)
    assert torch.equal(ops.attention(q, unused, unused, cache, head, D ** -0.5), want)


@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
@pytest.mark.parametrize(("block_size", "kv_dtype"), SPARSE_LAYOUTS)
@pytest.mark.parametrize("full", [(), (1, 3)], ids=["all-sparse", "mixed"])
def test_per_head_block_subsets_match_gathered_oracle(ops, block_size, kv_dtype, full):
    """Each KV head reads its own random subset of its sequence's blocks, in a random
    order, to its own length (the last listed block may be partial); the sequences in
    ``full`` keep their whole table for every head, as next to sparse ones in a batch."""
    lens = [300, 45, 200, 16]
    cache, tables, _ = scatter_sequences(lens, block_size, 64, seed=3, dtype=kv_dtype)
    g = torch.Generator().manual_seed(block_size)
    chosen, head_lens = [], torch.empty(len(lens), KVH, dtype=torch.long)
    for i, (table, length) in enumerate(zip(tables, lens)):
        for kh in range(KVH):
            if i in full:
                chosen.append(table)
                head_lens[i, kh] = length
                continue
            n = int(torch.randint(1, len(table) + 1, (1,), generator=g))
            chosen.append(table[torch.randperm(len(table), generator=g)[:n]])
            head_lens[i, kh] = (n - 1) * block_size + int(
                torch.randint(1, block_size + 1, (1,), generator=g))
    head_tables = torch.zeros(len(lens), KVH, max(len(c) for c in chosen), dtype=torch.long)
    for row, c in zip(head_tables.view(-1, head_tables.shape[2]), chosen):
        row[:len(c)] = c
    q = torch.randn(len(lens), H, D, generator=g)
    meta = decode_meta(tables, lens, block_size, head_tables, head_lens)
    unused = torch.empty(len(lens), KVH, D)
    got = ops.attention(q, unused, unused, cache, meta, D ** -0.5)
    want = gathered_attention(q, cache, head_tables, head_lens, D ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def int16_rounded(q, scale):
    """q as the decode kernel scores int8 keys with it: each (token, head) row of q * scale
    rounded to int16 steps of its largest magnitude / 32767, half to even, then / scale."""
    scaled = q * scale
    step = scaled.abs().amax(dim=-1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    return torch.round(scaled / step).clamp(-32767, 32767) * step / scale


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
def test_cpu_decode_kernel_merges_a_long_contexts_pieces(kv_dtype):
    """With fewer (sequence, KV head) contexts than twice the threads, the kernel cuts each
    context into pieces of whole blocks, one task each, and merges their softmax sums
    (paged_attention_cpu.cpp). One sequence on two threads: 2 contexts of up to 2000
    tokens make 2 pieces each; head 1 holds 5 tokens, so its first piece is empty. Scores
    spread wide, so a piece merged without its rescale to the context's max is far off."""
    assert load_cpu_kernels() is None
    g = torch.Generator().manual_seed(11)
    block_size, num_blocks = 16, 160
    cache = torch.randn(2, num_blocks, block_size, KVH, D, generator=g) * 3
    cache = quantize_rows(cache) if kv_dtype == torch.int8 else cache.to(kv_dtype)
    head_tables = torch.stack([torch.randperm(num_blocks, generator=g)[:125]
                               for _ in range(KVH)]).unsqueeze(0)
    head_lens = torch.tensor([[2000, 5]])
    q = torch.randn(1, H, D, generator=g) * 2
    meta = decode_meta([head_tables[0, 0]], [2000], block_size, head_tables, head_lens)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = CpuOps().attention(q, q[:, :KVH], q[:, :KVH], cache, meta, D ** -0.5)
    finally:
        torch.set_num_threads(threads)
    if kv_dtype == torch.int8:   # scored with the query rounded to int16, as below
        q, values = int16_rounded(q, D ** -0.5), dequantize_rows(cache, torch.float32)
    else:
        values = cache
    want = gathered_attention(q, values, head_tables, head_lens, D ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_cpu_decode_kernel_rejects_head_lengths_and_blocks_outside_its_inputs():
    """Per-head tables come from a block selector: a length past the head's table or a
    block outside the pool is an error, not a read out of bounds."""
    assert load_cpu_kernels() is None
    cache = torch.randn(2, 4, 16, KVH, D)
    q = torch.randn(1, H, D)
    tables = torch.tensor([[[0, 1], [2, 3]]])
    with pytest.raises(RuntimeError, match="length 33 of sequence 0 head 1 outside 1..32"):
        torch.ops.llm_cluster.paged_decode_attention(q, cache[0], cache[1], tables,
                                                     torch.tensor([[32, 33]]), 1.0)
    with pytest.raises(RuntimeError, match="block 4 outside the pool of 4"):
        torch.ops.llm_cluster.paged_decode_attention(q, cache[0], cache[1], tables + 1,
                                                     torch.tensor([[17, 17]]), 1.0)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
def test_write_kv_lands_in_the_mapped_slots(ops, order):
    pool, cache = in_pool(torch.zeros(2, 4, 16, KVH, D), order)
    k, v = torch.randn(3, KVH, D), torch.randn(3, KVH, D)
    slots = torch.tensor([5, 16 * 2 + 15, 16 * 3])
    ops.write_kv(k, v, cache, slots)
    assert torch.equal(cache[0, 0, 5], k[0]) and torch.equal(cache[1, 2, 15], v[1])
    assert torch.equal(cache[0, 3, 0], k[2])
    # nothing written anywhere else, in this layer or another
    assert sum(int((layer != 0).sum()) for layer in pool) == 2 * 3 * KVH * D


def test_rms_norm_and_rotary_match_formulas():
    ops = TorchOps()
    x, w = torch.randn(5, 32), torch.randn(32)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), want)
    pos = torch.tensor([0, 3, 7])
    theta = torch.outer(torch.arange(8.0), 1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    q, k = torch.randn(3, H, D), torch.randn(3, KVH, D)
    rq, rk = ops.rotary(q, k, pos, theta.cos(), theta.sin())
    for i, p in enumerate(pos.tolist()):  # rotate each (j, j + D/2) pair by angle theta[p, j]
        for j in range(D // 2):
            c, s = math.cos(theta[p, j]), math.sin(theta[p, j])
            a, b = q[i, 0, j].item(), q[i, 0, j + D // 2].item()
            assert rq[i, 0, j].item() == pytest.approx(a * c - b * s, abs=1e-5)
            assert rq[i, 0, j + D // 2].item() == pytest.approx(b * c + a * s, abs=1e-5)
    assert rk.shape == k.shape


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"),
                         [(8, 2, 16), (9, 3, 16), (7, 1, 40), (10, 2, 32)])
def test_cpu_decode_kernel_head_sizes_match_reference(head_dim, kv_dtype, heads, kv_heads,
                                                      block_size):
    """The kernel's compiled-size paths (vector dot, in-register sums, its own exp, int8
    keys' integer products, int8 rows summed for up to 4 query heads at once) against the
    reference decode, with lengths that end mid-block and scores spread wide enough that
    the softmax is far from uniform. GQA groups of 4, 3, 7 and 5 query heads cover every
    chunk of heads the int8 paths split a group into; blocks of 40 rows, the int8 keys'
    16 rows at a time with a remainder. Over int8 keys the kernel scores a query rounded
    to int16 (int16_rounded), so the reference gets that query."""
    assert load_cpu_kernels() is None
    g = torch.Generator().manual_seed(head_dim)
    num_blocks = 640 // block_size
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g) * 3
    cache = quantize_rows(cache) if kv_dtype == torch.int8 else cache.to(kv_dtype)
    lens = torch.tensor([1, 17, 300, 333, 16])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), tables, lens,
                             [], block_size)
    scale = head_dim ** -0.5
    got = CpuOps().attention(q, q[:, :kv_heads], q[:, :kv_heads], cache, meta, scale)
    scored = int16_rounded(q, scale) if kv_dtype == torch.int8 else q
    want = TorchOps().attention(scored, q[:, :kv_heads], q[:, :kv_heads], cache, meta, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_fused_ops_match_reference(kv_dtype):
    """Each fused CPU op against the torch reference on the layouts the decoder passes:
    q/k/v as strided views of one fused projection, rows past one parallel task (16),
    widths off the 16-lane vector size. Rotary and the KV write round as torch does, so
    they must match bit for bit."""
    assert load_cpu_kernels() is None
    cpu, ref = CpuOps(), TorchOps()
    g = torch.Generator().manual_seed(7)
    tokens, heads, kv_heads, d = 37, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 4
    theta = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    pos = torch.randint(0, 64, (tokens,), generator=g)

    def views(t):
        q, k, v = t.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)

    q, k, v = views(qkv.clone())
    want_q, want_k = ref.rotary(q.clone(), k.clone(), pos, theta.cos(), theta.sin())
    got_q, got_k = cpu.rotary(q, k, pos, theta.cos(), theta.sin())
    torch.testing.assert_close(got_q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)

    slots = torch.randperm(40 * 16, generator=g)[:tokens]
    caches = [torch.zeros(2, 40, 16, kv_heads, d, dtype=kv_dtype) for _ in range(2)]
    ref.write_kv(got_k, v, caches[0], slots)
    cpu.write_kv(got_k, v, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
    with pytest.raises(RuntimeError, match="slot 640 outside the pool of 640"):
        cpu.write_kv(got_k[:1], v[:1], caches[1], torch.tensor([640]))

    h, delta = torch.randn(2, tokens, 100, generator=g)
    w = torch.randn(100, generator=g)
    torch.testing.assert_close(cpu.rms_norm(h, w, 1e-6), ref.rms_norm(h, w, 1e-6))
    want_h, want_x = ref.add_rms_norm(h.clone(), delta, w, 1e-6)
    got_h, got_x = cpu.add_rms_norm(h.clone(), delta, w, 1e-6)
    torch.testing.assert_close(got_h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(got_x, want_x)

    gate_up = torch.randn(tokens, 2 * 100, generator=g) * 10  # wide: exp's clamps are hit
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_a_float64_matmul(ops, rows):
    """Each ops' packed linear is ``x @ W.T + b`` to fp32 rounding; on the CPU oneDNN's
    packed weights are among the candidates timed (the fast path must not fall back
    silently)."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(80, 96, generator=g), \
        torch.randn(80, generator=g)
    packed = ops.pack_linear(w)
    if ops.name == "cpu":
        assert onednn_linear_problem() is None
        assert set(ops.chooser.choices[("fp32", (80, 96))].timings_ms[0]) == {"mkl", "onednn"}
    exact = x.double() @ w.double().T + b.double()
    for bias, want in ((b, exact), (None, exact - b.double())):
        got = ops.linear(x, packed, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 80)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
