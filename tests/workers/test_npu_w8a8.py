"""W8A8 dynamic linear layers on the torch_npu ops, through the fake torch_npu: the calls
vllm-ascend's w8a8_dynamic method makes (``npu_dynamic_quant`` + ``npu_quant_matmul``
on an [in, out] NZ weight), checked against the scheme's definition and, for whole
generations, against the reference ops computing the same scheme: symmetric per-token
activations, where the other devices' w8a8 is asymmetric."""

from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from workers.ops import TorchOps, get_ops, torch_ref
from workers.ops.quant_linear import Int8Weight, quantize_rows

CPU = torch.device("cpu")


def int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 by the definition, in float64."""
    t = t.double()
    scale = t.abs().amax(dim=1) / 127
    return torch.round(t / scale[:, None]).clamp(-127, 127), scale


def symmetric_w8a8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None
                          ) -> torch.Tensor:
    """The reference ops' ``w8a8_linear`` with npu_dynamic_quant's symmetric per-token
    activations: the NPU's scheme on the CPU."""
    x2 = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows(x2)
    out = torch._int_mm(qx, w.qweight_t).float().mul_(sx[:, None]).mul_(w.scale)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_w8a8_linear_calls_dynamic_quant_then_quant_matmul(fake_npu, monkeypatch, dtype):
    state = fake_npu(soc="Ascend910B3")
    ops = get_ops(CPU, "npu")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    x = (torch.randn(5, 64, generator=g) * torch.logspace(-1, 1, 5)[:, None]).to(dtype)
    packed = ops.pack_linear(w, "w8a8")
    got = ops.linear(x, packed, bias)

    cast = next(c for c in state.calls if c.name == "npu_format_cast")
    assert cast.args["acl_format"] == 29 and cast.args["input"].shape == (64, 48)
    quant = next(c for c in state.calls if c.name == "npu_dynamic_quant")
    assert quant.args["x"].shape == (5, 64) and quant.args["smooth_scales"] is None
    mm = next(c for c in state.calls if c.name == "npu_quant_matmul")
    assert mm.args["x2"] is packed.qweight_t and mm.args["output_dtype"] == dtype
    assert mm.args["scale"].dtype == torch.float32 and mm.args["bias"] is bias

    qx, sx = int8_rows(x)
    qw, sw = int8_rows(w)
    want = (qx @ qw.T) * sx[:, None] * sw[None, :] + bias.double()
    assert got.dtype == dtype and got.shape == (5, 48)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
    # The CPU reference with symmetric activations: equal up to the output's rounding.
    monkeypatch.setattr(torch_ref, "w8a8_linear", symmetric_w8a8_linear)
    ref = TorchOps()
    torch.testing.assert_close(got, ref.linear(x, ref.pack_linear(w, "w8a8"), bias))


def test_w8a8_is_refused_where_the_npu_ops_cannot_run_it(fake_npu):
    fake_npu(soc="Ascend910B3")
    with pytest.raises(ValueError, match=r"model\.dtype float16 or bfloat16.*got float32"):
        get_ops(CPU, "npu").pack_linear(torch.randn(8, 8), "w8a8")
    fake_npu(soc="Ascend310P3")
    with pytest.raises(ValueError, match=r"'w8a8' on an Ascend 310P.*use w8a16 or none"):
        get_ops(CPU, "npu").pack_linear(torch.randn(8, 8).half(), "w8a8")


@pytest.mark.slow
def test_greedy_w8a8_text_on_the_npu_ops_equals_the_cpu_w8a8_path(fake_npu, tiny_factory,
                                                                  monkeypatch):
    """fp16 compute (what npu_dynamic_quant takes), chunked prefill and several
    sequences in a batch: the reference ops' w8a8 greedy tokens, with symmetric
    activations as the NPU's. The fake's fp16
    attention rounds differently from the reference's, and per-token quantization turns
    such a rounding into a different int8 step, so a random tiny model's near-flat
    logits may part at a near tie: each sequence must agree until its first difference,
    where the reference's top two log-probabilities are within 0.05, and one sequence
    must agree throughout. A wrong weight layout, scale or bias parts at the first token
    by far more."""
    tiny = tiny_factory("qwen2")   # q/k/v biases go into npu_quant_matmul too
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = dict(device="cpu", dtype="float16", quantization="w8a8", kv_cache_bytes=1 << 20,
              block_size=32, max_model_len=200, max_num_batched_tokens=32)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0] for o in outs]

    with monkeypatch.context() as patch:
        patch.setattr(torch_ref, "w8a8_linear", symmetric_w8a8_linear)
        want = run(LLM(tiny.path, ops="torch", **kw))
    state = fake_npu(soc="Ascend910B3")
    got = run(LLM(tiny.path, ops="npu", **kw))
    whole = 0
    for ours, ref in zip(got, want):
        parted = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids))
                       if a != b), None)
        if parted is None:
            whole += 1
            continue
        top2 = sorted((lp.logprob for lp in ref.logprobs[parted].values()), reverse=True)
        assert parted > 0 and top2[0] - top2[1] < 0.05, (parted, ref.logprobs[parted])
    assert whole >= 1
    names = state.names()
    assert names.count("npu_dynamic_quant") == names.count("npu_quant_matmul") > 0
