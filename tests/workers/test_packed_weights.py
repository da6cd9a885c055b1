"""The packed weights of the CPU's weight-streaming kernels and of w8a16's batch kernels
against oracles written here: the layouts by their index formulas, and the int8 (w8a16)
and fp16 products in float64 from the weights as stored and, for int8, the activations
rounded to int16 per row by definition (scale = amax / 32767, round half to even)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels
from workers.ops.linear_choice import LinearImpl
from workers.ops.packed_weights import (
    BLOCK,
    pack_half,
    pack_int8,
    pack_lane_tiles,
    pack_rows,
    packs_int8,
    run_blocked,
    run_half,
    run_int8,
    run_lane_tiles,
)
from workers.ops.quant_linear import Int8Weight, quantize_weight


@pytest.fixture(scope="module", autouse=True)
def kernels():
    problem = load_cpu_kernels()
    assert problem is None, f"CPU kernels failed to build: {problem}"


def test_a_block_of_channels_is_one_run_of_steps():
    """[out / 8, in / cols, 8, cols], zero-padded: W[o, i] sits at [o // 8, i // cols,
    o % 8, i % cols]."""
    w = torch.arange(10 * 40, dtype=torch.float32).view(10, 40) + 1
    packed = pack_rows(w, 32)
    assert packed.shape == (2, 2, BLOCK, 32)
    for o in range(16):
        for i in range(64):
            want = w[o, i] if o < 10 and i < 40 else 0
            assert packed[o // 8, i // 32, o % 8, i % 32] == want


def _int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int16 per row, dequantized (the kernel's activations)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 32767, torch.ones_like(amax))
    return torch.round(x / scale).double() * scale.double()


def _weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-1, 1, out)[:, None]
    return w, torch.randn(out, generator=g)


@pytest.mark.parametrize("out,inp", [(603, 192), (603, 40), (16, 1536)],
                         ids=["groups", "padded-width", "wide"])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_the_int8_kernel_is_the_int16_activations_product(out, inp, rows):
    """Scales per 64 input columns where 64 divides the width (else per channel), an
    output count and a width that need padding, a zero row, leading dimensions, bias."""
    w, bias = _weights(out, inp, seed=out + inp)
    int8 = quantize_weight(w, "w8a16")
    assert packs_int8(int8)
    groups = int8.scale.shape[1] if int8.scale.dim() == 2 else 1
    dequant = (int8.qweight.double().view(out, groups, -1)
               * int8.scale.double().view(out, groups, 1)).view(out, inp)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, inp, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    x[1, 0] = 0
    want = _int16_rows(x) @ dequant.T + bias.double()
    got = run_int8(x, pack_int8(int8), bias)
    assert got.shape == (2, rows, out) and got.dtype == torch.float32
    assert torch.equal(got[1, 0], bias)
    # Exact integer sums; fp32 only in the per-group scaling and the final sum (6e-7 at
    # most over 15 seeds; a wrong scale or rounding would be 1e-4 or more).
    rel = (got.double() - want).abs() / want.abs().amax(dim=-1, keepdim=True)
    assert rel.max() < 1e-5


def _lane_tiles_or_skip() -> None:
    if not torch.ops.llm_cluster.w8a16_tiles_available():
        pytest.skip("w8a16's batch kernels need AVX-512 BW, which this build lacks")


def _fp16_products():
    yield run_half, pack_half
    yield run_blocked, pack_half
    if torch.ops.llm_cluster.w8a16_tiles_available():
        yield run_lane_tiles, pack_lane_tiles


@pytest.mark.parametrize("out,inp", [(603, 576), (10, 40)])
@pytest.mark.parametrize("rows", [3, 21])
def test_the_fp16_kernel_is_the_fp16_weights_product(out, inp, rows):
    """The decode kernel, the blocked GEMM and the batch kernel (partial row and block
    tiles: 21 rows, 603 channels)."""
    w, bias = _weights(out, inp, seed=7)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(8))
    want = x.double() @ w.half().double().T + bias.double()
    for run, pack in _fp16_products():
        # fp32 sums: up to 1.7e-6 over 15 seeds (the GEMM's order depends on alignment);
        # the weights' fp16 rounding is 5e-4.
        got = run(x, pack(w), bias)
        rel = (got.double() - want).abs() / want.abs().amax(dim=-1, keepdim=True)
        assert got.shape == (rows, out) and rel.max() < 1e-5, run.__name__


def test_lane_tiles_put_16_channels_side_by_side_per_step():
    """int8: [out / 16, in / 2, 16, 2], W[o, i] at [o // 16, i // 2, o % 16, i % 2] and
    the scale of (o, group g) at [o // 16, g, o % 16]; fp16: [out / 16, in, 16, 1];
    padding channels zero."""
    q = torch.arange(20 * 128, dtype=torch.int32).view(20, 128).remainder(251).sub(125)
    scale = torch.arange(1, 41, dtype=torch.float32).view(20, 2)
    tiled = pack_lane_tiles(Int8Weight.from_int8("w8a16", q.to(torch.int8), scale))
    half = pack_lane_tiles(q.float())
    assert tiled.data.shape == (2, 64, 16, 2) and tiled.scale.shape == (2, 2, 16)
    assert half.data.shape == (2, 128, 16, 1) and half.scale is None
    for o in range(32):
        for i in range(128):
            want = q[o, i] if o < 20 else 0
            assert tiled.data[o // 16, i // 2, o % 16, i % 2] == want
            assert half.data[o // 16, i, o % 16, 0] == want
        for g in range(2):
            assert tiled.scale[o // 16, g, o % 16] == (scale[o, g] if o < 20 else 0)


@pytest.mark.parametrize("out,inp,groups", [(603, 192, 3), (603, 40, 1), (37, 1536, 1),
                                            (24, 96, 2)],
                         ids=["groups", "narrow", "wide-one-scale", "groups-of-48"])
@pytest.mark.parametrize("rows", [1, 6, 17])
def test_the_lane_tiled_int8_product_is_the_int16_activations_product(out, inp, groups, rows):
    """Partial row tiles (6, 17 rows), partial block groups (603 and 37 channels), a
    scale per channel over 1,536 inputs (several int32 spans), groups of 48 columns that
    the decode kernel cannot take, leading dimensions, a zero row, bias."""
    _lane_tiles_or_skip()
    g = torch.Generator().manual_seed(out + inp + rows)
    q = torch.randint(-128, 128, (out, inp), dtype=torch.int8, generator=g)
    scale = torch.rand(out, groups, generator=g) + 0.5
    weight = Int8Weight.from_int8("w8a16", q, scale if groups > 1 else scale[:, 0])
    dequant = (q.double().view(out, groups, -1) * scale.double()[:, :, None]).view(out, inp)
    bias = torch.randn(out, generator=g)
    x = torch.randn(2, rows, inp, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    x[1, 0] = 0
    got = run_lane_tiles(x, pack_lane_tiles(weight), bias)
    assert got.shape == (2, rows, out) and got.dtype == torch.float32
    assert torch.equal(got[1, 0], bias)
    want = _int16_rows(x) @ dequant.T + bias.double()
    rel = (got.double() - want).abs() / want.abs().amax(dim=-1, keepdim=True)
    assert rel.max() < 1e-5


def test_the_lane_tiled_int8_sums_stay_exact_at_the_largest_products():
    """One scale over 1,536 inputs, every product 32767 * -128: the int32 sums must be
    flushed to fp32 before they overflow (one sum over all inputs would wrap)."""
    _lane_tiles_or_skip()
    q = torch.full((16, 1536), -128, dtype=torch.int8)
    weight = Int8Weight.from_int8("w8a16", q, torch.ones(16))
    x = torch.ones(4, 1536)
    got = run_lane_tiles(x, pack_lane_tiles(weight), None)
    assert torch.equal(got, torch.full((4, 16), -128.0 * 1536))


def test_the_cpu_ops_offer_the_batch_kernels_for_w8a16_weights_and_the_fp16_head():
    _lane_tiles_or_skip()
    ops = CpuOps()
    w, _ = _weights(48, 128, seed=9)
    assert "int16-tiles" in [c.name for c in ops.linear_candidates(quantize_weight(w, "w8a16"))]
    assert "fp16-tiles" in [c.name for c in ops.linear_candidates(w.half())]
    odd = Int8Weight.from_int8("w8a16", torch.ones(48, 65, dtype=torch.int8), torch.ones(48))
    assert "int16-tiles" not in [c.name for c in ops.linear_candidates(odd)]


def test_dequantized_blocks_of_a_packed_weight_are_the_weight_as_stored():
    """``rows`` (the blocked GEMM's source) at block-aligned starts and ragged stops."""
    w, _ = _weights(603, 192, seed=3)
    int8 = quantize_weight(w, "w8a16")
    dequant = (int8.qweight.float().view(603, 3, 64) * int8.scale[:, :, None]).view(603, 192)
    packed, half = pack_int8(int8), pack_half(w)
    for start, stop in ((0, 256), (256, 512), (512, 603), (8, 9)):
        assert torch.equal(packed.rows(start, stop), dequant[start:stop])
        assert torch.equal(half.rows(start, stop), w.half().float()[start:stop])


def test_groups_that_are_not_whole_steps_keep_the_dequantizing_path():
    """A pre-quantized weight with 2 groups of 48 columns: the decode kernel cannot take
    it, so the CPU ops offer blocked dequantization, which still computes it (and the
    batch kernel where it runs, tested above)."""
    w, bias = _weights(24, 96, seed=4)
    q = torch.randint(-127, 128, (24, 96), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(4))
    int8 = Int8Weight.from_int8("w8a16", q, torch.rand(24, 2, generator=torch.Generator()
                                                        .manual_seed(6)) + 0.5)
    assert not packs_int8(int8)
    ops = CpuOps()
    assert [c.name for c in ops.linear_candidates(int8)][0] == "dequant"
    assert "int8-kernel" not in [c.name for c in ops.linear_candidates(int8)]
    ops.linear_candidates = lambda w: CpuOps.linear_candidates(ops, w)[:1]
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    dequant = (q.double().view(24, 2, 48) * int8.scale.double()[:, :, None]).view(24, 96)
    got = ops.linear(x, ops.pack_linear(int8), bias).double()
    # fp32 summation of 97 terms: within 97 * 2^-24 of the sum of their magnitudes
    bound = 97 * 2.0 ** -24 * (x.double().abs() @ dequant.abs().T + bias.double().abs())
    assert ((got - (x.double() @ dequant.T + bias.double())).abs() <= bound).all()


@pytest.mark.parametrize("out,inp", [(603, 96), (10, 40), (16, 1536)])
def test_the_packed_w8a8_product_is_int_mm_exactly(out, inp):
    """The same int32 sums as ``torch._int_mm``, padding included, for every row count
    of the kernel's row tiles, and at the largest magnitudes (every product 127 * 127, or
    -128 * 127), so the CPU ops may pick either."""
    g = torch.Generator().manual_seed(out)
    w = quantize_weight(torch.randn(out, inp, generator=g), "w8a8")
    w.qweight_t[:, 0] = 127
    packed = pack_int8(w)
    for rows in (1, 2, 3, 4, 5, 8, 17):
        qx = torch.randint(-128, 128, (rows, inp), dtype=torch.int8, generator=g)
        qx[0] = 127
        if rows > 1:
            qx[-1, 1:] = -128
        got = torch.ops.llm_cluster.int8_packed_mm(qx, packed.data, out)
        want = torch._int_mm(qx, w.qweight_t)
        assert got.dtype == torch.int32 and torch.equal(got, want)
        assert got[0, 0] == 127 * 127 * inp
        if rows > 1:
            assert got[-1, 0] == -128 * 127 * (inp - 1) + int(qx[-1, 0]) * 127


def test_a_w8a16_model_on_the_batch_kernels_gives_the_reference_logits(tiny_factory, monkeypatch):
    """Every linear layer and the fp16 head of a tiny llama on the batch kernels alone, over
    a 40-token prompt in 16-token chunks, against the torch reference ops (fp32 products
    of the dequantized weights). The int16 rounding of the activations, amplified by the
    random layers, moves the logits by 1.3e-4 of their range (the decode kernel, which
    rounds alike: 1.4e-4; blocked dequantization: 6e-7)."""
    _lane_tiles_or_skip()
    from benchmarks.quantization_quality import forced_logits
    from cluster import LLM

    path = tiny_factory("llama").path
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setenv("LLM_CLUSTER_OPS", "torch")
    want = forced_logits(LLM(path, device="cpu", quantization="w8a16"), ids, chunk=16)
    monkeypatch.delenv("LLM_CLUSTER_OPS")
    monkeypatch.setattr(CpuOps, "linear_candidates", lambda self, w: [
        c for c in CpuOps._lane_tiles("tiles", w) if not isinstance(w, torch.Tensor)
        or w.dtype == torch.float16] or [LinearImpl("mkl", torch.Tensor.contiguous, F.linear)])
    llm = LLM(path, device="cpu", quantization="w8a16")
    model = llm.engine.runner.model
    assert {model.lm_head.choice.names} | {w.choice.names for w in (
        model.layers[0].qkv_w, model.layers[0].down_w)} == {("tiles",) * 4}
    got = forced_logits(llm, ids, chunk=16)
    err = (got - want).abs().max() / (want.amax() - want.amin())
    assert err < 1e-3
