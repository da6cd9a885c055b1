"""SmoothQuant for w8a8 (workers/models/smoothquant.py, calibration.py).

Oracles: HF transformers' fp32 forward of the same tiny random checkpoint (logits, and
forward hooks on its projections for the activation maxima), and the factors computed
here channel by channel from the HF parameters.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
import torch

from workers.loading import load_checkpoint
from workers.models import calibration
from workers.models.calibration import KINDS, activation_maxima, prefill
from workers.models.decoder import DecoderLM
from workers.models.smoothquant import ALPHA, smooth_for_w8a8, smooth_weights
from workers.ops import TorchOps
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels, onednn_linear_problem
from workers.ops.linear_choice import LinearChooser

CPU = torch.device("cpu")


def token_ids(seed: int, n: int = 48) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def logits(cfg, weights, ids: list[int], quantization: str = "none",
           int8_schemes=MappingProxyType({})) -> torch.Tensor:
    model = DecoderLM(cfg, weights, TorchOps(), len(ids), CPU, torch.float32, quantization,
                      int8_schemes)
    return model.compute_logits(prefill(model, [ids], CPU))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "pangu", "qwen3"])
def test_smoothing_alone_keeps_the_fp32_logits(tiny_factory, arch):
    """pangu: q/k/v and o biases (v's bias is divided too); qwen3: q/k norms, head_dim
    32 != hidden / heads. Both have grouped query heads (4 over 2 KV heads)."""
    tiny = tiny_factory(arch)
    ck = load_checkpoint(tiny.path)
    smoothed = smooth_weights(ck.config, ck.weights,
                              activation_maxima(ck.config, ck.weights, token_ids(1), CPU))
    norm = "model.layers.0.input_layernorm.weight"
    assert (smoothed[norm] / ck.weights[norm] - 1).abs().max() > 0.1  # really rescaled
    ids = token_ids(2)
    torch.testing.assert_close(logits(ck.config, smoothed, ids), hf_logits(tiny.hf, ids),
                               rtol=0, atol=1e-4)


def test_activation_maxima_are_the_projections_inputs(tiny_factory):
    tiny = tiny_factory("pangu")
    ck = load_checkpoint(tiny.path)
    ids = token_ids(3)
    seen: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(
        lambda mod, args, out, name=name: seen.__setitem__(name, args[0][0].abs().amax(0)))
        for name, module in tiny.hf.named_modules()
        if name.endswith(("q_proj", "o_proj", "gate_proj", "down_proj"))]
    hf_logits(tiny.hf, ids)
    for h in hooks:
        h.remove()
    got = activation_maxima(ck.config, ck.weights, ids, CPU)
    for i, m in enumerate(got):
        p = f"model.layers.{i}."
        for ours, name in ((m.qkv, "self_attn.q_proj"), (m.o, "self_attn.o_proj"),
                           (m.gate_up, "mlp.gate_proj"), (m.down, "mlp.down_proj")):
            torch.testing.assert_close(ours, seen[p + name], rtol=1e-4, atol=1e-5)


def test_activation_maxima_do_not_depend_on_the_linear_kernel_timed_fastest(
        default_model_path, monkeypatch):
    """MKL and oneDNN round the same product differently (at the default model's
    widths; a tiny model's agree), and which one a layer gets is timed at load. The
    maxima, and through them every rounding of the quantized weights, must come out
    bit-equal either way, or a loaded w8a8 model depends on the machine's load."""
    assert load_cpu_kernels() is None
    if onednn_linear_problem() is not None:
        pytest.skip(f"oneDNN's linear: {onednn_linear_problem()}")
    ck = load_checkpoint(default_model_path)
    ids = calibration.calibration_ids(ck.tokenizer)[:48]
    offered = CpuOps.linear_candidates
    got = []
    for name in ("mkl", "onednn"):
        monkeypatch.setattr(CpuOps, "linear_candidates", lambda self, w, name=name:
                            [c for c in offered(self, w) if c.name == name])
        monkeypatch.setattr(calibration, "calibration_ops",
                            lambda device: CpuOps(LinearChooser()))
        got.append(activation_maxima(ck.config, ck.weights, ids, CPU))
    for mkl, onednn in zip(*got):
        for kind in KINDS:
            assert torch.equal(getattr(mkl, kind), getattr(onednn, kind)), kind


def test_factors_and_folds_of_one_layer_by_hand(tiny_factory):
    tiny = tiny_factory("pangu")
    ck = load_checkpoint(tiny.path)
    cfg, w = ck.config, ck.weights
    maxima = activation_maxima(cfg, w, token_ids(4), CPU)
    out = smooth_weights(cfg, w, maxima)
    p, m = "model.layers.1.", maxima[1]
    a = p + "self_attn."

    def factor(x_max: float, w_max: float) -> float:
        return x_max ** ALPHA / w_max ** (1 - ALPHA)

    s_qkv = []
    for j in range(cfg.hidden_size):  # QKV: folded into the input norm
        w_max = max(abs(w[a + n + "_proj.weight"][r, j].item())
                    for n in "qkv" for r in range(w[a + n + "_proj.weight"].shape[0]))
        s = factor(m.qkv[j].item(), w_max)
        s_qkv.append(s)
        assert out[p + "input_layernorm.weight"][j].item() == pytest.approx(
            w[p + "input_layernorm.weight"][j].item() / s, rel=1e-5)
        assert out[a + "k_proj.weight"][3, j].item() == pytest.approx(
            w[a + "k_proj.weight"][3, j].item() * s, rel=1e-5)
    group, hd = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    for kvh in range(cfg.num_kv_heads):  # O: one factor per value channel, over the group
        for d in range(hd):
            cols = [(kvh * group + g) * hd + d for g in range(group)]
            x_max = max(m.o[c].item() for c in cols)
            w_max = max(abs(v) for c in cols for v in w[a + "o_proj.weight"][:, c].tolist())
            s = factor(x_max, w_max)
            row = kvh * hd + d
            assert out[a + "v_proj.weight"][row, 0].item() == pytest.approx(  # and QKV's
                w[a + "v_proj.weight"][row, 0].item() * s_qkv[0] / s, rel=1e-5)
            assert out[a + "v_proj.bias"][row].item() == pytest.approx(
                w[a + "v_proj.bias"][row].item() / s, rel=1e-5)
            for c in cols:
                assert out[a + "o_proj.weight"][5, c].item() == pytest.approx(
                    w[a + "o_proj.weight"][5, c].item() * s, rel=1e-5)


def with_outlier_channels(cfg, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same function with a few hidden channels 30x larger after each norm (their
    consumers' columns 30x smaller): the activation outliers real LLMs have and random
    weights lack."""
    out = dict(weights)
    big = torch.ones(cfg.hidden_size)
    big[[3, 17, 40]] = 30.0
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm, names in ((p + "input_layernorm", ["self_attn.q_proj", "self_attn.k_proj",
                                                     "self_attn.v_proj"]),
                            (p + "post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"])):
            out[norm + ".weight"] = weights[norm + ".weight"] * big
            for n in names:
                out[p + n + ".weight"] = weights[p + n + ".weight"] / big
    return out


def test_w8a8_with_smoothing_is_closer_to_fp32(tiny_factory):
    tiny = tiny_factory("llama")
    ck = load_checkpoint(tiny.path)
    cfg = ck.config
    weights = with_outlier_channels(cfg, ck.weights)
    smoothed = smooth_weights(cfg, weights, activation_maxima(cfg, weights, token_ids(5), CPU))
    ids = token_ids(6, 64)
    ref = hf_logits(tiny.hf, ids)
    torch.testing.assert_close(logits(cfg, weights, ids), ref, rtol=0, atol=1e-4)
    plain = (logits(cfg, weights, ids, "w8a8") - ref).pow(2).mean().sqrt().item()
    smooth = (logits(cfg, smoothed, ids, "w8a8") - ref).pow(2).mean().sqrt().item()
    assert smooth < 0.5 * plain, f"rms logit error: smoothed {smooth}, plain {plain}"


def test_int8_checkpoints_and_tokenizerless_ones_are_left_as_given(tiny_factory, caplog):
    ck = load_checkpoint(tiny_factory("llama").path)
    assert smooth_for_w8a8(ck.config, ck.weights, None, CPU) is ck.weights
    assert "no tokenizer" in caplog.text
    int8 = {**ck.weights, "model.layers.0.mlp.up_proj.weight":
            torch.zeros(2, 2, dtype=torch.int8)}
    assert smooth_for_w8a8(ck.config, int8, object(), CPU) is int8


class ByteTokenizer:
    """Token ids from the text's bytes, inside the tiny vocabulary (the tiny checkpoints
    have no tokenizer files)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b % 250 for b in text.encode()]


@pytest.mark.parametrize("quantization", ["w8a8", "w8a16", "none"])
def test_the_runner_smooths_only_what_w8a8_quantizes(tiny_factory, quantization):
    from kvcache.config import CacheConfig
    from workers.model_runner import ModelRunner
    from workers.models.calibration import CALIBRATION_TOKENS, calibration_ids

    ck = dataclasses.replace(load_checkpoint(tiny_factory("llama").path),
                             tokenizer=ByteTokenizer())
    ids = calibration_ids(ck.tokenizer)
    assert len(ids) == CALIBRATION_TOKENS
    runner = ModelRunner(ck, CacheConfig(kv_cache_bytes=1 << 20), CPU, 64,
                         quantization=quantization)
    expected = (smooth_weights(ck.config, ck.weights,
                               activation_maxima(ck.config, ck.weights, ids, CPU))
                if quantization == "w8a8" else ck.weights)
    for i, layer in enumerate(runner.model.layers):
        p = f"model.layers.{i}."
        torch.testing.assert_close(layer.in_norm, expected[p + "input_layernorm.weight"])
        torch.testing.assert_close(layer.post_norm,
                                   expected[p + "post_attention_layernorm.weight"])
