"""Int8 linear layers against a dequantize-then-compute oracle written here: scales by
their definition (weights: amax / 127 per row; W8A8's activations: the row's range with
0 in it / 255, and a zero point), the integer product accumulated exactly in int64, and
the fp32 product of the dequantized weight for w8a16."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ConfigError, config_from_dict
from workers.ops import TorchOps
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels
from workers.ops.quant_linear import Int8Weight


def all_ops():
    problem = load_cpu_kernels()
    assert problem is None, f"CPU kernels failed to build: {problem}"
    return [TorchOps(), CpuOps()]


def symmetric_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 by the definition, in float64."""
    t = t.double()
    scale = t.abs().max(dim=1).values / 127
    q = torch.round(t / scale[:, None]).clamp(-127, 127)
    return q.long(), scale


def asymmetric_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row asymmetric int8 by the definition, in float64: the dequantized rows
    (q - zero) * scale, and the scale."""
    t = t.double()
    lo, hi = t.min(dim=1).values.clamp(max=0), t.max(dim=1).values.clamp(min=0)
    scale = (hi - lo) / 255
    zero = -128 - torch.round(lo / scale)
    q = (torch.round(t / scale[:, None]) + zero[:, None]).clamp(-128, 127)
    return (q - zero[:, None]).long(), scale


def inputs(rows: int, seed: int, out: int = 80, inp: int = 96):
    g = torch.Generator().manual_seed(seed)
    # Rows of very different sizes: per-token and per-channel scales must both matter.
    x = torch.randn(rows, inp, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    w = torch.randn(out, inp, generator=g) * torch.logspace(-1, 1, out)[:, None]
    bias = torch.randn(out, generator=g)
    return x, w, bias


@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_w8a8_is_the_exact_int32_product_rescaled(ops, rows):
    x, w, bias = inputs(rows, seed=rows)
    packed = ops.pack_linear(w, "w8a8")
    qw, sw = symmetric_int8(w)
    int8 = TorchOps().pack_linear(w, "w8a8")
    assert torch.equal(int8.qweight.long(), qw)
    torch.testing.assert_close(int8.scale.double(), sw, rtol=1e-6, atol=0)
    qx, sx = asymmetric_int8(x)   # its int8 values less their zero point
    exact = (qx @ qw.T).double()  # int64: no rounding anywhere
    expected = exact * sx[:, None] * sw[None, :] + bias.double()
    got = ops.linear(x, packed, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    # int32 accumulation is exact, so only the fp32 rescale rounds (a few ulps).
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=2e-6 * expected.abs().max())


@pytest.mark.parametrize("ops", all_ops(), ids=lambda o: o.name)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 300])
@pytest.mark.parametrize("inp,group", [(96, 96), (192, 64)], ids=["per-channel", "groups"])
def test_w8a16_is_the_dequantized_weights_product(ops, rows, inp, group):
    """Both the small-batch kernel (<= 16 rows; four channels at a time, then the rest
    one by one) and the blocked path (more rows, more than one block of output
    channels); a width that 64 divides gets a scale per 64 input columns of each
    channel (96 does not: one per channel)."""
    x, w, bias = inputs(rows, seed=100 + rows, out=603, inp=inp)   # 603: not 4 | out
    packed = ops.pack_linear(w, "w8a16")
    qw, sw = symmetric_int8(w.reshape(-1, group))
    # The product is checked on the int8 values the engine chose: a weight whose w/scale
    # lies within fp32 rounding of a .5 tie may round the other way than in float64.
    int8 = TorchOps().pack_linear(w, "w8a16")
    assert (int8.qweight.reshape(-1, group).long() - qw).abs().max() <= 1
    torch.testing.assert_close(int8.scale.reshape(-1).double(), sw, rtol=1e-6, atol=0)
    dequant = (int8.qweight.reshape(-1, group).double() * sw[:, None]).reshape(603, inp)
    expected = x.double() @ dequant.T + bias.double()
    got = ops.linear(x.view(1, rows, inp), packed, bias)
    assert got.shape == (1, rows, 603)
    # fp32 accumulation: errors relative to each row's size (rows span 4 decades). The
    # CPU kernel also rounds each activation row to int16 (1/65534 of its largest value;
    # test_linear_choice checks it against that exact oracle).
    rel = (got[0].double() - expected).abs() / expected.abs().amax(dim=1, keepdim=True)
    assert rel.max() < (1e-5 if isinstance(ops, TorchOps) and not isinstance(ops, CpuOps)
                        else 1e-4)


def test_group_scales_are_only_for_w8a16():
    q = torch.zeros(4, 128, dtype=torch.int8)
    assert Int8Weight.from_int8("w8a16", q, torch.ones(4, 2)).scale.shape == (4, 2)
    assert Int8Weight.from_int8("w8a8", q, torch.ones(4, 1)).scale.shape == (4,)
    with pytest.raises(ValueError, match=r"got shape \(4, 2\) for a weight \[4, 128\]"):
        Int8Weight.from_int8("w8a8", q, torch.ones(4, 2))
    with pytest.raises(ValueError, match="groups dividing the input width"):
        Int8Weight.from_int8("w8a16", q, torch.ones(4, 3))


def test_pre_quantized_weights_are_used_as_stored():
    x, w, _ = inputs(4, seed=7)
    qw, sw = symmetric_int8(w)
    given = Int8Weight.from_int8("w8a8", qw.to(torch.int8), sw.float())
    ops = TorchOps()
    assert ops.pack_linear(given) is given
    torch.testing.assert_close(ops.linear(x, given), ops.linear(x, ops.pack_linear(w, "w8a8")))
    with pytest.raises(ValueError, match="expected one per channel"):
        Int8Weight.from_int8("w8a8", qw.to(torch.int8), sw[:3].float())


def test_zero_rows_quantize_to_zero_outputs():
    x, w, _ = inputs(3, seed=3)
    x[1] = 0
    got = TorchOps().linear(x, TorchOps().pack_linear(w, "w8a8"))
    assert torch.equal(got[1], torch.zeros(80)) and got.isfinite().all()


def test_unknown_quantization_fails_at_start_naming_the_choices():
    with pytest.raises(ConfigError, match=r"model\.quantization: got 'int4'; allowed: none, "
                                          r"w8a8, w8a16"):
        config_from_dict({"model": {"quantization": "int4"}})
    assert config_from_dict({"model": {"quantization": "w8a16"}}).model.quantization == "w8a16"


@pytest.mark.parametrize("quantization,head", [("w8a8", "fp32"), ("w8a16", "fp16")])
def test_a_worker_quantizes_its_decoder_layers_and_its_head_as_the_scheme_says(
        tiny_factory, quantization, head):
    """The setting reaches a Ray worker's model through its spec (plain values); w8a16
    keeps the LM head in fp16, w8a8 in the compute dtype (quant_linear.head_quantization)."""
    from kvcache.config import CacheConfig
    from workers.worker import Worker, WorkerSpec

    spec = WorkerSpec(tiny_factory("llama").path, None, "float32", "cpu", 0, "auto",
                      CacheConfig(kv_cache_bytes=1 << 20), None, 1, quantization=quantization)
    model = Worker(spec, "mixed").runner.model
    layer = model.layers[0]
    for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w):
        assert w.choice.kind == quantization   # CPU ops: int8 weights, kernel chosen
    assert model.lm_head.choice.kind == head


def test_the_fused_per_token_quantization_equals_the_torch_definition():
    """The CPU ops' one-pass kernel gives quantize_activations' int8 values, scales and
    zero points bit for bit: zero rows, rows of one sign, values on a rounding tie
    (x / scale = k + 0.5), rows of any count."""
    all_ops()
    from workers.ops.quant_linear import quantize_activations

    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 96, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    x[4] = 0
    x[5, :4] = torch.tensor([127.0, 0.5, -2.5, -128.0])   # scale 1, zero 0: ties at 0.5, -2.5
    x[5, 4:] = 0
    x[6] = x[6].abs()                                      # lo = 0: zero point -128
    q, s, z = torch.ops.llm_cluster.quantize_rows_int8(x)
    want_q, want_s, want_z = quantize_activations(x)
    assert torch.equal(q, want_q) and torch.equal(s, want_s) and torch.equal(z, want_z)
    assert q[5, :4].tolist() == [127, 0, -2, -128] and s[5] == 1 and z[5] == 0
    assert z[6] == -128 and q[6].max() == 127   # 0 at -128, the largest value at 127
    assert s[4] == 1 and torch.equal(q[4].long() - z[4], torch.zeros(96, dtype=torch.long))


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_rescale_equals_the_torch_definition(with_bias):
    """The CPU ops' one-pass W8A8 rescale gives the reference ops' output bit for bit:
    the int32 product less the zero point times the channel's weight sum, times the
    row's, then the column's scale, the bias added after that product is rounded (no
    fused multiply-add)."""
    from workers.ops.quant_linear import quantize_activations

    all_ops()
    x, w, bias = inputs(37, seed=11)
    bias = bias if with_bias else None
    got = CpuOps().linear(x, CpuOps().pack_linear(w, "w8a8"), bias)
    int8 = TorchOps().pack_linear(w, "w8a8")
    qx, sx, zx = quantize_activations(x)
    exact = (qx.long() - zx[:, None]) @ int8.qweight.long().t()   # int64
    want = exact.to(torch.int32).float() * sx[:, None] * int8.scale
    assert torch.equal(got, want + bias if with_bias else want)
    assert torch.equal(got, TorchOps().linear(x, int8, bias))


def test_the_fused_w8a8_mlp_is_the_unfused_ops_bit_for_bit():
    """``dequantize_silu_mul_quantize`` equals dequantize_int32, silu_and_mul and
    quantize_rows_int8 one after the other (a zero row included), and the CPU ops' W8A8
    MLP equals the same ops composed through ``linear``."""
    ops = all_ops()[1]
    g = torch.Generator().manual_seed(11)
    acc = torch.randint(-2**20, 2**20, (37, 2 * 200), dtype=torch.int32, generator=g)
    row_zero = torch.randint(-128, 128, (37,), dtype=torch.int32, generator=g)
    col_sums = torch.randint(-2000, 2000, (400,), dtype=torch.int32, generator=g)
    acc[3], row_zero[3] = 0, 0
    row_scale, col_scale = torch.rand(37, generator=g) * 1e-3, torch.rand(400, generator=g) * 1e-3
    operands = (acc, row_scale, row_zero, col_scale, col_sums)
    q, s, z = torch.ops.llm_cluster.dequantize_silu_mul_quantize(*operands)
    act = torch.ops.llm_cluster.silu_and_mul(
        torch.ops.llm_cluster.dequantize_int32(*operands, None))
    want_q, want_s, want_z = torch.ops.llm_cluster.quantize_rows_int8(act)
    assert torch.equal(q, want_q) and torch.equal(s, want_s) and torch.equal(z, want_z)
    assert s[3] == 1
    gate_up = ops.pack_linear(torch.randn(2 * 96, 48, generator=g), "w8a8")
    down = ops.pack_linear(torch.randn(48, 96, generator=g), "w8a8")
    for rows in (1, 40):
        x = torch.randn(rows, 48, generator=g)
        got = ops.mlp(x, gate_up, down)
        assert got.shape == (rows, 48)
        assert torch.equal(got, ops.linear(ops.silu_and_mul(ops.linear(x, gate_up)), down))


def test_a_w8a8_weight_is_one_int8_copy():
    """``_int_mm`` reads the [in, out] layout; the [out, in] weight is a view of it."""
    q = torch.randint(-127, 128, (24, 40), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(2))
    w = Int8Weight.from_int8("w8a8", q, torch.ones(24))
    assert torch.equal(w.qweight, q) and torch.equal(w.qweight_t, q.T)
    assert w.qweight.untyped_storage().data_ptr() == w.qweight_t.untyped_storage().data_ptr()


TILE_KERNELS = {"int8-amx": "amx", "int8-vnni": "vnni"}   # candidate -> op prefix


def _tile_kernel_or_skip(name: str):
    """The tile kernel's ops: ``<prefix>_int8_mm`` and ``<prefix>_w8a8_linear``."""
    all_ops()
    prefix = TILE_KERNELS[name]
    if not getattr(torch.ops.llm_cluster, f"{prefix}_int8_available")():
        pytest.skip(f"no {name} on this processor or in this build (AMX also needs Linux "
                    "to grant the tile state)")
    return (getattr(torch.ops.llm_cluster, f"{prefix}_int8_mm"),
            getattr(torch.ops.llm_cluster, f"{prefix}_w8a8_linear"))


@pytest.mark.parametrize("kernel", TILE_KERNELS)
@pytest.mark.parametrize("rows,inp,out", [
    (1, 64, 16), (5, 128, 40), (16, 576, 96), (17, 192, 33), (64, 128, 48),
    (65, 64, 16), (130, 256, 70), (300, 576, 200)])
def test_a_tile_kernel_product_is_the_exact_int32_product(kernel, rows, inp, out):
    """Partial row tiles, channels past the last whole block of 16, several groups of
    rows; the sums of extreme values included. Oracle: int64 products, and for the
    rescale fused into the kernel the separate rescale of those."""
    from workers.ops.packed_weights import pack_tiles

    int8_mm, w8a8_linear = _tile_kernel_or_skip(kernel)
    g = torch.Generator().manual_seed(rows + inp + out)
    qx = torch.randint(-127, 128, (rows, inp), dtype=torch.int8, generator=g)
    q = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=g)
    qx[0], q[0], q[-1] = 127, 127, -127
    qx[-1, ::2] = -127
    want = (qx.long() @ q.long().t()).to(torch.int32)
    packed = pack_tiles(Int8Weight.from_int8("w8a8", q, torch.ones(out)),
                        amx=kernel == "int8-amx")
    assert torch.equal(int8_mm(qx, packed.data, out), want)
    row_scale, col_scale = torch.rand(rows, generator=g), torch.rand(out, generator=g)
    row_zero = torch.randint(-128, 128, (rows,), dtype=torch.int32, generator=g)
    bias = torch.randn(out, generator=g)
    for b in (None, bias):   # the fused rescale: dequantize_int32 of the exact sums
        assert torch.equal(
            w8a8_linear(qx, row_scale, row_zero, packed.data, col_scale, packed.channel_sums,
                        b, out),
            torch.ops.llm_cluster.dequantize_int32(want, row_scale, row_zero, col_scale,
                                                   packed.channel_sums, b))


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_the_cpu_ops_offer_a_tile_kernel_for_whole_tiles_and_its_linear_is_the_others(kernel):
    """Inputs a multiple of 64 get the tile kernel's candidate, which gives the other
    candidates' output bit for bit (bias included); other widths do not. On its weights
    the fused MLP is its ops composed. A wrongly packed weight is refused with the shape
    expected."""
    int8_mm, _ = _tile_kernel_or_skip(kernel)
    ops = CpuOps()
    x, w, bias = inputs(37, seed=13, out=80, inp=128)
    weight = TorchOps().pack_linear(w, "w8a8")
    by_name = {c.name: c for c in ops.linear_candidates(weight)}
    assert {"int8-mm", "int8-packed", kernel} <= set(by_name)
    outs = [c.run(x, c.pack(weight), bias) for c in by_name.values()]
    assert all(torch.equal(o, outs[0]) for o in outs)
    narrow = TorchOps().pack_linear(torch.zeros(80, 96), "w8a8")
    assert set(TILE_KERNELS).isdisjoint(c.name for c in ops.linear_candidates(narrow))
    tiled_only = CpuOps()   # the W8A8 MLP on tiled weights: the fused path, as composed ops
    tiled_only.linear_candidates = lambda w: [by_name[kernel]]
    g = torch.Generator().manual_seed(14)
    gate_up, down = (tiled_only.pack_linear(torch.randn(*shape, generator=g), "w8a8")
                     for shape in ((2 * 128, 64), (64, 128)))
    assert {gate_up.choice.names, down.choice.names} == {(kernel,) * 4}
    for rows in (1, 40, 70):
        h = torch.randn(rows, 64, generator=g)
        assert torch.equal(tiled_only.mlp(h, gate_up, down), tiled_only.linear(
            tiled_only.silu_and_mul(tiled_only.linear(h, gate_up)), down))
    with pytest.raises(RuntimeError, match=r"in / 64, 16, 64\] for in = 128 and out = 80"):
        int8_mm(x.to(torch.int8), torch.zeros(5, 3, 16, 64, dtype=torch.int8), 80)
