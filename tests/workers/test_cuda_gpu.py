"""The CUDA paths on a real GPU, against the oracles their CPU tests use: the engine (CUDA
attention, decode steps replayed from captured graphs) against HF transformers on the
same GPU, graphs against eager steps, the int8 product against exact integer arithmetic,
sparse attention against dense, and KV handoffs between two pools bit for bit.

CI has no GPU, so these skip there. Where one is lent (Ray need not be installed):

    pytest -m cuda tests/workers/test_cuda_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from cluster import LLM
from cluster.config import config_from_dict
from kvcache.config import CacheConfig
from kvcache.device_transport import export_device, import_device
from kvcache.kv_transfer import KVTransferError
from tests.kvcache.test_kv_transfer import (
    assert_blocks_equal,
    make_meta,
    make_pool,
    seq_blocks,
    snapshot,
)
from tests.workers.test_decode_graphs import count_graph_runs, shrinking_batch
from tests.workers.test_model_parity import (
    ARCHS,
    GREEDY,
    assert_logits_match_hf,
    hf_greedy,
    prompts_for,
    spy_on,
)
from tests.workers.test_smoothquant import ByteTokenizer
from tests.workers.test_sparse_attention import REGIONS, generate
from tests.workers.test_worker import assert_handoff_continues_bit_exact
from workers.loading import load_checkpoint
from workers.models.calibration import activation_maxima, calibration_ids
from workers.ops.cuda import CudaOps
from workers.ops.quant_linear import quantize_activations, quantize_weight
from workers.worker import Worker, WorkerSpec

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def hf_on_gpu(tiny_factory):
    """The tiny checkpoints' HF models on the GPU (copies: other tests use them on the CPU)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(arch: str) -> torch.nn.Module:
        if arch not in cache:
            cache[arch] = copy.deepcopy(tiny_factory(arch).hf).to(CUDA)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prefill", "chunked-prefill"])
def test_the_engine_on_cuda_matches_hf_on_the_gpu(tiny_factory, hf_on_gpu, arch, budget):
    llm = LLM(tiny_factory(arch).path, device="cuda", kv_cache_bytes=4 << 20,
              max_num_batched_tokens=budget)
    runner = llm.engine.runner
    assert runner.ops.name == "cuda" and runner.kv_caches[0].is_cuda
    runs = count_graph_runs(runner)
    spy = spy_on(llm)
    prompts = prompts_for(0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    hf = hf_on_gpu(arch)
    worst = assert_logits_match_hf(hf, spy, [p + o.outputs[0].token_ids
                                             for p, o in zip(prompts, outs)])
    print(f"{arch}, budget {budget}: max |logits - HF on the GPU| = {worst:.2e}")
    assert runs   # decode-only steps ran from graphs
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


def test_graph_decodes_equal_eager_decodes(tiny_factory):
    """The batch of 5 runs padded to 8, of 3 to 4."""
    prompts, params = shrinking_batch()
    kw = dict(device="cuda", kv_cache_bytes=1 << 20, max_model_len=512)
    eager = LLM(tiny_factory("llama").path, enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    graphed = LLM(tiny_factory("llama").path, **kw)
    runs = count_graph_runs(graphed.engine.runner)
    results = []
    for llm in (eager, graphed):
        spy = spy_on(llm)
        outs = llm.generate(prompts, params)
        results.append(([o.outputs[0].token_ids for o in outs],
                        {tuple(c): row for c, row in spy.rows}))
    (want, want_rows), (got, got_rows) = results
    assert got == want and got_rows.keys() == want_rows.keys()
    worst = max((got_rows[c] - want_rows[c]).abs().max().item() for c in want_rows)
    print(f"graphs against eager: max |logits difference| = {worst:.2e}")
    assert worst <= 1e-4
    assert set(runs) == {(8, 16), (4, 16), (4, 32), (2, 16), (1, 16)}


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64])
@pytest.mark.parametrize(("out", "inp"), [(96, 128), (128, 64), (1536, 576), (576, 1536)])
def test_w8a8_products_on_cuda_are_exact_integer_sums(rows, out, inp):
    """Rows padded to a size cuBLASLt's int8 product takes; the int32 sums less the zero
    points' share equal float64 sums of the products of (int8 - zero point) and the int8
    weights, which are exact at these sizes."""
    g = torch.Generator().manual_seed(rows)
    w = quantize_weight(torch.randn(out, inp, generator=g), "w8a8")
    x, bias = torch.randn(rows, inp, generator=g), torch.randn(out, generator=g)
    got = CudaOps(None).int8_linear(x.to(CUDA), _to_cuda(w), bias.to(CUDA)).cpu()
    qx, sx, zx = quantize_activations(x)
    exact = ((qx.double() - zx[:, None]) @ w.qweight.double().T).float()
    want = exact.mul_(sx[:, None]).mul_(w.scale).add_(bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _to_cuda(w):
    return type(w).from_int8(w.scheme, w.qweight.to(CUDA), w.scale.to(CUDA))


@pytest.mark.parametrize("quantization", ["w8a8", "w8a16"])
def test_quantized_engine_on_cuda_matches_the_reference_ops(tiny_factory, quantization):
    """The same int8 weights (quantized elementwise, so alike on both devices) through the
    CUDA ops with graphs and through the reference ops on the CPU: the CPU and GPU sum in
    different orders, so a per-token activation rounding may flip; the logits stay close."""
    path = tiny_factory("qwen2").path
    prompts = prompts_for(1)
    rows = []
    for device in ("cuda", "cpu"):
        llm = LLM(path, device=device, ops="auto" if device == "cuda" else "torch",
                  kv_cache_bytes=4 << 20, quantization=quantization)
        spy = spy_on(llm)
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        rows.append({tuple(c): row.cpu() for c, row in spy.rows})
    common = rows[0].keys() & rows[1].keys()
    assert len(common) >= len(rows[1]) // 2
    worst = max((rows[0][c] - rows[1][c]).abs().max().item() for c in common)
    print(f"{quantization}: max |logits CUDA - reference on the CPU| = {worst:.2e}")
    assert worst <= 2e-2


def test_smoothquant_calibration_on_cuda_matches_the_cpu(tiny_factory):
    ck = load_checkpoint(tiny_factory("pangu").path)
    ids = calibration_ids(ByteTokenizer())[:64]
    on_gpu = activation_maxima(ck.config, ck.weights, ids, CUDA)
    on_cpu = activation_maxima(ck.config, ck.weights, ids, torch.device("cpu"))
    for g, c in zip(on_gpu, on_cpu):
        for a, b in ((g.qkv, c.qkv), (g.o, c.o), (g.gate_up, c.gate_up), (g.down, c.down)):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ops", ["torch", "auto"])
def test_sparse_attention_with_a_full_budget_equals_dense_on_cuda(tiny_long_factory, ops):
    """The reference ops on CUDA tensors: bit-identical, as on the CPU. The CUDA ops'
    dense decode is one SDPA call while sparse decodes go per KV head: close."""
    path = tiny_long_factory("llama").path

    def make(long_context: dict | None) -> LLM:
        return LLM(config=config_from_dict({
            "model": {"path": path, "device": "cuda", "ops": ops, "enforce_eager": True},
            "cache": {"kv_cache_bytes": 4 << 20}, "long_context": long_context or {}}))

    dense_tokens, dense_rows = generate(make(None))
    for mode in ("sparse", "offload"):
        regions = {**REGIONS, "top_k_percent": 1.0}
        if mode == "sparse":
            regions["offload_boundary"] = 2048
        llm = make(regions)
        tokens, rows = generate(llm)
        assert tokens == dense_tokens and rows.keys() == dense_rows.keys()
        for context, row in rows.items():
            if ops == "torch":
                assert torch.equal(row, dense_rows[context]), (mode, len(context))
            else:
                torch.testing.assert_close(row, dense_rows[context], rtol=0, atol=1e-4)
        stats = llm.engine.runner.long_context.stats
        assert stats.selections > 0
        if mode == "offload":
            assert stats.offloaded_blocks > 0 and stats.recalled_blocks > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_device_transport_between_cuda_pools_is_bit_exact(dtype):
    meta = make_meta(dtype)
    src, dst = ([kv.to(CUDA) for kv in make_pool(meta, 8, seed)] for seed in (5, 6))
    batch, rows = export_device(src, [5, 0, 7], *seq_blocks(meta, 3), meta)
    assert rows.is_cuda
    import_device(batch, rows, dst, [3, 6, 1], meta)
    assert_blocks_equal(dst, [3, 6, 1], src, [5, 0, 7])
    before = snapshot(dst)
    rows.view(torch.uint8).view(3, -1)[1, 99] ^= 0x10
    with pytest.raises(KVTransferError, match="KV block 1: .* corrupted in transfer"):
        import_device(batch, rows, dst, [2, 4, 0], meta)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(dst, before))


def test_a_worker_handoff_on_cuda_continues_bit_exact(tiny_factory):
    """Export and import on the side stream (``kv_streams``) while steps run on the compute
    stream; the receiver continues as the sender would have."""
    spec = WorkerSpec(tiny_factory("llama").path, None, "float32", "cuda", 0, "auto",
                      CacheConfig(kv_cache_bytes=1 << 20), None, 1)
    assert_handoff_continues_bit_exact(Worker(spec, "prefill"), Worker(spec, "decode"))
