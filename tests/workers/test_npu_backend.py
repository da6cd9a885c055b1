"""The torch_npu ops backend, driven through a fake torch_npu on CPU tensors: its calls
(names, keywords, shapes, dtypes, formats) and what it does with their results, op by
op against the reference ops, and whole generations against the CPU path."""

from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from kvcache.kv_layout import LAYOUT_ND, LAYOUT_NZ, nd_to_nz, nz_to_nd
from kvcache.kv_tensors import KVShape
from workers.ops import AttentionMetadata, PrefillSegment, TorchOps, get_ops

SOCS = {LAYOUT_ND: "Ascend910B3", LAYOUT_NZ: "Ascend310P3"}
CPU = torch.device("cpu")
KVH, H, D = 2, 6, 16


def scatter_sequences(lengths, block_size, num_blocks, seed, dtype):
    """Random contexts in randomly chosen, non-contiguous blocks of an ND pool layer:
    (layer, block tables, each context's (keys, values) in fp32)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, KVH, D, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, contexts = [], []
    for length in lengths:
        nb = -(-length // block_size)
        table = torch.tensor([free.pop() for _ in range(nb)])
        flat = cache[:, table].reshape(2, nb * block_size, KVH, D)[:, :length].float()
        tables.append(table)
        contexts.append((flat[0], flat[1]))
    return cache, tables, contexts

def paged_case(block_size, dtype):
    """A mixed batch over a scattered paged cache of ``dtype``: 3 decodes (contexts 1, 37
    and 300) and 2 prefill chunks ((query, context) = (20, 20) and (9, 130)); the new
    tokens' keys and values are those already in the cache."""
    decode_lens, prefill = [1, 37, 300], [(20, 20), (9, 130)]
    cache, tables, ctx = scatter_sequences(decode_lens + [c for _, c in prefill], block_size,
                                           num_blocks=40, seed=block_size, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    n = len(decode_lens) + sum(q for q, _ in prefill)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    k, v = torch.empty(n, KVH, D), torch.empty(n, KVH, D)
    width = max(len(t) for t in tables[:3])
    dec = torch.zeros(3, width, dtype=torch.long)
    for i in range(3):
        dec[i, :len(tables[i])] = tables[i]
        k[i], v[i] = ctx[i][0][-1], ctx[i][1][-1]
    segments, start = [], 3
    for j, (ql, cl) in enumerate(prefill):
        k[start:start + ql], v[start:start + ql] = ctx[3 + j][0][cl - ql:], ctx[3 + j][1][cl - ql:]
        segments.append(PrefillSegment(start, ql, cl, tables[3 + j]))
        start += ql
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.long), 3, dec,
                             torch.tensor(decode_lens), segments, block_size)
    return q, k, v, cache, meta



def npu_ops(fake_npu, layout, **kw):
    state = fake_npu(soc=SOCS[layout], **kw)
    ops = get_ops(CPU, "npu")
    assert ops.name == "npu" and ops.kv_layout == layout
    return ops, state


def as_layout(cache: torch.Tensor, layout: str, ops, state) -> torch.Tensor:
    """An ND pool layer [2, nb, bs, KVH, D] as the backend allocates it in ``layout``."""
    if layout == LAYOUT_ND:
        return cache
    nb, bs = cache.shape[1], cache.shape[2]
    shape = KVShape(1, bs, KVH, D, cache.dtype, LAYOUT_NZ)
    (nz,) = ops.allocate_kv(shape, nb, CPU)
    nz.copy_(nd_to_nz(cache.reshape(2, nb, bs, KVH * D)))
    return nz


@pytest.mark.parametrize("layout", [LAYOUT_ND, LAYOUT_NZ])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_write_kv_lands_where_the_definition_reads_it(fake_npu, layout, dtype):
    ops, state = npu_ops(fake_npu, layout)
    shape = KVShape(1, 32, KVH, D, dtype, layout)
    (pool,) = ops.allocate_kv(shape, 6, CPU)
    assert tuple(pool.shape) == shape.layer_shape(6)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 9, KVH, D, generator=g)
    slots = torch.tensor([0, 5, 31, 32, 70, 100, 150, 191, 64])
    ops.write_kv(k, v, pool, slots)
    (call,) = [c for c in state.calls if c.name == "_npu_reshape_and_cache"]
    assert call.args["slot_indices"].dtype == torch.int32
    nd = pool if layout == LAYOUT_ND else nz_to_nd(pool, 32, KVH * D).view(2, 6, 32, KVH, D)
    flat = nd.reshape(2, 6 * 32, KVH, D)
    assert torch.equal(flat[0, slots], k.to(dtype)) and torch.equal(flat[1, slots], v.to(dtype))
    written = torch.zeros(6 * 32, dtype=torch.bool)
    written[slots] = True
    assert not flat[:, ~written].any(), "nothing but the mapped slots is written"


def test_an_older_release_writes_through_npu_scatter_pa_kv_cache(fake_npu):
    """Without ``_npu_reshape_and_cache`` the KV write takes ``npu_scatter_pa_kv_cache``,
    whose slot keyword is ``slot_mapping``."""
    calls = []
    state = fake_npu(without=("_npu_reshape_and_cache",))
    import torch_npu

    def scatter(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                compress_seq_offset=None, seq_lens=None):
        calls.append(slot_mapping)
        bs = key_cache.shape[1]
        key_cache[slot_mapping.long() // bs, slot_mapping.long() % bs] = key
        value_cache[slot_mapping.long() // bs, slot_mapping.long() % bs] = value

    torch_npu.npu_scatter_pa_kv_cache = scatter
    ops = get_ops(CPU, "npu")
    pool = torch.zeros(2, 4, 16, KVH, D)
    k, v = torch.randn(2, 3, KVH, D)
    ops.write_kv(k, v, pool, torch.tensor([1, 17, 40]))
    assert calls and calls[0].dtype == torch.int32 and "_npu_reshape_and_cache" not in state.names()
    assert torch.equal(pool[0].view(-1, KVH, D)[[1, 17, 40]], k)


@pytest.mark.parametrize("layout", [LAYOUT_ND, LAYOUT_NZ])
@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_and_chunked_prefill_match_the_reference(fake_npu, layout, block_size):
    ops, state = npu_ops(fake_npu, layout)
    scale = D ** -0.5
    q, k, v, cache, meta = paged_case(block_size, torch.float16)
    want = TorchOps().attention(q.float(), k, v, cache, meta, scale)
    got = ops.attention(q.float(), k, v, as_layout(cache, layout, ops, state), meta, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    names = state.names()
    assert "_npu_paged_attention" in names
    prefill_op = ("_npu_paged_attention_splitfuse" if layout == LAYOUT_NZ
                  else "npu_fused_infer_attention_score")
    assert prefill_op in names
    if layout == LAYOUT_NZ:
        assert "npu_format_cast" in names   # the splitfuse mask goes in as NZ


def test_norms_swiglu_and_rotary_go_through_torch_npu(fake_npu):
    ops, state = npu_ops(fake_npu, LAYOUT_ND)
    ref = TorchOps()
    g = torch.Generator().manual_seed(2)
    x, delta, w = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), \
        torch.randn(64, generator=g)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for a, b in zip(ops.add_rms_norm(x, delta, w, 1e-6), ref.add_rms_norm(x, delta, w, 1e-6)):
        assert torch.equal(a, b)
    gu = torch.randn(5, 128, generator=g)
    assert torch.equal(ops.silu_and_mul(gu), ref.silu_and_mul(gu))
    qkv = torch.randn(5, (H + 2 * KVH) * D, generator=g)
    q, k = qkv[:, :H * D].view(5, H, D), qkv[:, H * D:(H + KVH) * D].view(5, KVH, D)
    angles = torch.outer(torch.arange(40.0), torch.rand(D // 2, generator=g))
    pos = torch.tensor([0, 3, 9, 39, 7])
    want = ref.rotary(q.clone(), k.clone(), pos, angles.cos(), angles.sin())
    got = ops.rotary(q, k, pos, angles.cos(), angles.sin())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_swiglu",
            "_npu_rotary_embedding"} <= set(state.names())


@pytest.mark.slow
@pytest.mark.parametrize("layout", [LAYOUT_ND, LAYOUT_NZ])
def test_greedy_text_on_the_npu_path_equals_the_cpu_path(fake_npu, tiny_factory, layout):
    """Chunked prefill, prefix-cache hits and preemption, on the torch_npu ops and the
    310P NZ pool, give the reference ops' greedy tokens."""
    tiny = tiny_factory("qwen2")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 17, 9)]
    prompts += [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 2 layers x 2 KV heads x 16 dims x fp32 x 32 tokens: 16 KiB a block; 8 blocks.
    kw = dict(device="cpu", kv_cache_bytes=8 * 16384, block_size=32, max_model_len=200,
              max_num_batched_tokens=48)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler

    want, _ = run(LLM(tiny.path, ops="torch", **kw))
    state = fake_npu(soc=SOCS[layout])
    got, scheduler = run(LLM(tiny.path, ops="npu", **kw))
    assert got == want
    assert scheduler.num_preemptions > 0 and scheduler.kv.stats.hit_tokens > 0
    names = set(state.names())
    assert {"_npu_reshape_and_cache", "_npu_paged_attention"} <= names
    assert ("_npu_paged_attention_splitfuse" if layout == LAYOUT_NZ
            else "npu_fused_infer_attention_score") in names


def test_handoff_from_an_nd_worker_to_a_310p_worker_and_back(fake_npu, tiny_factory):
    """A CPU (ND) prefill worker hands a sequence to a 310P (NZ) decode worker, which
    continues it exactly, and hands it back bit-exactly."""
    from kvcache.config import CacheConfig
    from scheduler.protocol import (
        ContinuedSequence,
        NewSequence,
        StepOutput,
        StepPlan,
        decode,
        encode,
    )
    from workers.worker import Worker, WorkerSpec

    path = tiny_factory("llama").path

    def worker(ops: str) -> Worker:
        cache = CacheConfig(block_size=16, kv_cache_bytes=1 << 20)
        return Worker(WorkerSpec(path, None, "float32", "cpu", 0, ops, cache, None, 1), "mixed")

    def step(w: Worker, plan: StepPlan) -> list[int]:
        return [t for o in decode(StepOutput, w.step(encode(plan))).outputs for t in o.token_ids]

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = list(range(5, 45))
    nd = worker("torch")
    fake_npu(soc="Ascend310P3")
    nz = worker("npu")
    assert nz.meta.layout == LAYOUT_NZ and nd.meta.layout == LAYOUT_ND
    first = step(nd, StepPlan(0, new=[NewSequence("s", prompt, 40, 0, [0, 1, 2], 40, greedy)]))
    _, batch = nd.export_kv([0, 1, 2], [None] * 3, [16, 16, 8])
    nz.import_kv(batch, [7, 3, 9])
    here = step(nd, StepPlan(1, continued=[ContinuedSequence("s", [], 1)]))
    there = step(nz, StepPlan(0, new=[NewSequence("s", prompt + first, 40, 40, [7, 3, 9], 1,
                                                   greedy)]))
    assert here == there
    before = [kv[:, [0, 1, 2]].clone() for kv in nd.runner.kv_caches]
    for kv in nd.runner.kv_caches:
        kv.zero_()
    _, back = nz.export_kv([7, 3, 9], [None] * 3, [16, 16, 8])
    nd.import_kv(back, [0, 1, 2])
    for kv, want in zip(nd.runner.kv_caches, before):
        assert torch.equal(kv[:, [0, 1, 2]][:, :2], want[:, :2])   # full blocks
        assert torch.equal(kv[:, 2, :8], want[:, 2, :8])            # the written part
