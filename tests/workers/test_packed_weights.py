"""The packed weights of the CPU's weight-streaming kernels against oracles written here:
the layout by its index formula, and the int8 (w8a16) and fp16 products in float64 from
the weights as stored and, for int8, the activations rounded to int16 per row by
definition (scale = amax / 32767, round half to even)."""

from __future__ import annotations

import pytest
import torch

from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels
from workers.ops.packed_weights import (
    BLOCK,
    pack_half,
    pack_int8,
    pack_rows,
    packs_int8,
    run_blocked,
    run_half,
    run_int8,
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


@pytest.mark.parametrize("out,inp", [(603, 576), (10, 40)])
def test_the_fp16_kernel_is_the_fp16_weights_product(out, inp):
    w, bias = _weights(out, inp, seed=7)
    x = torch.randn(3, inp, generator=torch.Generator().manual_seed(8))
    want = x.double() @ w.half().double().T + bias.double()
    for run in (run_half, run_blocked):
        # fp32 sums: up to 1.7e-6 over 15 seeds (the GEMM's order depends on alignment);
        # the weights' fp16 rounding is 5e-4.
        got = run(x, pack_half(w), bias)
        rel = (got.double() - want).abs() / want.abs().amax(dim=-1, keepdim=True)
        assert got.shape == (3, out) and rel.max() < 1e-5, run.__name__


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
    """A pre-quantized weight with 2 groups of 48 columns: the kernel cannot take it, so
    the CPU ops offer only blocked dequantization, which still computes it."""
    w, bias = _weights(24, 96, seed=4)
    q = torch.randint(-127, 128, (24, 96), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(4))
    int8 = Int8Weight.from_int8("w8a16", q, torch.rand(24, 2, generator=torch.Generator()
                                                        .manual_seed(6)) + 0.5)
    assert not packs_int8(int8)
    ops = CpuOps()
    assert [c.name for c in ops.linear_candidates(int8)] == ["dequant"]
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
