"""Int8 KV: the write op stores symmetric int8 with an fp16 scale per token and KV head, and
decode and prefill attention (torch reference and the C++ decode kernel) equal dense
attention over keys and values dequantized by the definition, computed here in
float64; on the engine, a prefix-cache hit computes the logits a cold run does."""

from __future__ import annotations

import math

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.config import ConfigError, config_from_dict
from workers.ops import AttentionMetadata, PrefillSegment, TorchOps
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels

KVH, H, D, BS = 2, 6, 16, 16


def all_ops():
    problem = load_cpu_kernels()
    assert problem is None, f"CPU kernels failed to build: {problem}"
    return [TorchOps(), CpuOps()]


def by_definition(x: torch.Tensor) -> torch.Tensor:
    """x [L, KVH, D] quantized per (token, head) to int8 with an fp16 scale, and back,
    in float64."""
    x = x.double()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).half().double()
    return torch.round(x / scale).clamp(-127, 127) * scale


def dense(q, keys, values, scale):
    """q [n, H, D] at the last n positions of keys/values [L, KVH, D], float64."""
    n, length, group = q.shape[0], keys.shape[0], H // KVH
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        visible = length - n + i + 1
        for h in range(H):
            k, v = keys[:visible, h // group], values[:visible, h // group]
            out[i, h] = torch.softmax(k @ q[i, h].double() * scale, dim=0) @ v
    return out


def test_the_cpu_kernel_writes_the_rows_the_definition_stores():
    """The C++ write quantizes as ``kv_quant.quantize_rows`` does, byte for byte: heads
    of very different sizes, a zero head, one whose scale falls below fp16's range,
    and values on a rounding tie; the other slots stay untouched."""
    from kvcache.kv_quant import quantize_rows

    all_ops()
    g = torch.Generator().manual_seed(5)
    k = torch.randn(40, KVH, D, generator=g) * torch.logspace(-4, 4, 40)[:, None, None]
    v = torch.randn(40, KVH, D, generator=g)
    k[3, 0], k[4, 1] = 0.0, 1e-9
    v[5, 0] = 0.0
    v[5, 0, :3] = torch.tensor([127.0, 0.5, -2.5])   # scale 1: ties at 0.5 and -2.5
    slots = torch.randperm(32 * BS, generator=g)[:40]
    got = torch.full((2, 32, BS, KVH, D + 2), 7, dtype=torch.int8)
    want = got.clone()
    torch.ops.llm_cluster.write_kv(k, v, got, slots)   # the kernel itself, no fallback
    TorchOps().write_kv(k, v, want, slots)
    assert torch.equal(got, want)
    assert torch.equal(got[1].view(-1, KVH, D + 2)[slots[5], 0, :3],
                       torch.tensor([127, 0, -2], dtype=torch.int8))
    assert torch.equal(want[0].view(-1, KVH, D + 2)[slots], quantize_rows(k))


@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
def test_int8_cache_write_decode_and_prefill_match_dequantized_dense(ops):
    g = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    lengths = [1, 37, 70, 20, 45]   # three decodes, a whole prompt, a chunk over a prefix
    queries = [1, 1, 1, 20, 9]
    cache = torch.zeros(2, 32, BS, KVH, D + 2, dtype=torch.int8)
    free = torch.randperm(32, generator=g).tolist()
    tables, ctx = [], []
    for length in lengths:
        table = torch.tensor([free.pop() for _ in range(math.ceil(length / BS))])
        keys = torch.randn(length, KVH, D, generator=g) * torch.rand(length, KVH, 1, generator=g)
        values = torch.randn(length, KVH, D, generator=g)
        pos = torch.arange(length)
        ops.write_kv(keys, values, cache, table[pos // BS] * BS + pos % BS)
        tables.append(table)
        ctx.append((keys, values))
    q = torch.randn(sum(queries), H, D, generator=g)
    k = torch.cat([c[0][-n:] for c, n in zip(ctx, queries)])
    v = torch.cat([c[1][-n:] for c, n in zip(ctx, queries)])
    dec = torch.zeros(3, max(len(t) for t in tables[:3]), dtype=torch.long)
    for i in range(3):
        dec[i, :len(tables[i])] = tables[i]
    segments = [PrefillSegment(3, 20, 20, tables[3]), PrefillSegment(23, 9, 45, tables[4])]
    meta = AttentionMetadata(torch.zeros(q.shape[0], dtype=torch.long), 3, dec,
                             torch.tensor(lengths[:3]), segments, BS)
    got = ops.attention(q, k, v, cache, meta, scale).double()
    start = 0
    for (keys, values), n in zip(ctx, queries):
        want = dense(q[start:start + n], by_definition(keys), by_definition(values), scale)
        torch.testing.assert_close(got[start:start + n], want, atol=2e-5, rtol=2e-5)
        start += n


class LogitsSpy:
    def __init__(self, sampler) -> None:
        self.inner, self.rows = sampler, []

    def __call__(self, logits, rows):
        self.rows.extend(logits.clone())
        return self.inner(logits, rows)


def test_prefix_cache_hit_logits_equal_a_cold_run(tiny_factory):
    path = tiny_factory("llama").path
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, 256, (40,), generator=g).tolist()
    follow = base[:36] + [11, 12, 13, 14]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rows = {}
    for run in ("cold", "hit"):
        llm = LLM(path, device="cpu", kv_cache_bytes=1 << 20, kv_cache_dtype="int8")
        if run == "hit":
            llm.generate({"prompt_token_ids": base}, params)
        spy = LogitsSpy(llm.engine.runner.sampler)
        llm.engine.runner.sampler = spy
        llm.generate({"prompt_token_ids": follow}, params)
        assert (llm.engine.scheduler.kv.stats.hit_tokens >= 32) == (run == "hit")
        rows[run] = torch.stack(spy.rows)
    # Same stored KV either way; only the attention's batch shapes differ (fp32 rounding).
    torch.testing.assert_close(rows["hit"], rows["cold"], atol=1e-5, rtol=0)


def test_an_unknown_kv_dtype_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="kv_dtype: got 'int4'; allowed: .*int8"):
        config_from_dict({"cache": {"kv_dtype": "int4"}})


def test_preemption_recomputes_what_a_roomy_pool_computes(tiny_factory):
    """A pool too small for all five sequences preempts and recomputes; the int8 KV it
    writes again is the same, so every greedy token equals a pool with room."""
    path = tiny_factory("llama").path
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 41, 25, 37, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    # 2 layers x 2 KV heads x (16 + 2) bytes x 2 (K, V) x 16 tokens: 2304 bytes a block.
    tight = LLM(path, device="cpu", kv_cache_bytes=14 * 2304, kv_cache_dtype="int8",
                max_model_len=200, max_num_batched_tokens=256)
    roomy = LLM(path, device="cpu", kv_cache_bytes=1 << 20, kv_cache_dtype="int8")
    outs = [[o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)] for llm in (tight, roomy)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert roomy.engine.scheduler.num_preemptions == 0
    assert outs[0] == outs[1]


def test_int8_kv_on_ops_without_it_fails_at_start(tiny_factory, monkeypatch):
    import workers.model_runner as model_runner

    class NoInt8(TorchOps):
        name, int8_kv = "no-int8", False

    monkeypatch.setattr(model_runner, "get_ops", lambda device, backend: NoInt8())
    with pytest.raises(ValueError, match="kv_dtype: got 'int8'; the no-int8 ops have no int8"):
        LLM(tiny_factory("llama").path, device="cpu", kv_cache_bytes=1 << 20,
            kv_cache_dtype="int8")


def test_block_summaries_of_int8_keys_are_of_the_dequantized_keys():
    from kvcache.block_summary import summarize
    from kvcache.kv_quant import quantize_rows

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(3, BS, KVH, D, generator=g)
    counts = torch.tensor([BS, 5, 1])
    for kind in ("mean", "minmax"):
        got = summarize(quantize_rows(keys), counts, kind)
        want = summarize(by_definition(keys).float(), counts, kind)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
