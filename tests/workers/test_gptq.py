"""GPTQ (workers/models/gptq.py) and the offline ``quantize`` command (cluster/quantize.py).

Oracles: round-to-nearest where GPTQ must reduce to it, the least-squares correction of
a second column worked out by hand, and a dense fp32 product of the same inputs.
"""

from __future__ import annotations

import dataclasses
import json
import pydoc_data.topics

import pytest
import torch
from safetensors.torch import load_file

from cluster import LLM, SamplingParams
from cluster.quantize import quantize_checkpoint
from tests.workers.test_smoothquant import CPU, ByteTokenizer, logits
from workers.loading import load_checkpoint
from workers.models.decoder import FUSED_MODULES
from workers.models.gptq import gptq_int8
from workers.models.smoothquant import smooth_for_w8a8
from workers.ops.quant_linear import quantize_rows


def test_with_uncorrelated_inputs_it_rounds_to_nearest():
    """A diagonal ``X^T X``: no column's error can be made up in another."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g)
    h = torch.diag(torch.rand(40, generator=g) + 0.1)
    q, scale = gptq_int8(w, h)
    want_q, want_scale = quantize_rows(w)
    assert torch.equal(q, want_q)
    torch.testing.assert_close(scale, want_scale)
    # Static groups of 8 columns: each on its own grid, the groups' maxima / 127.
    q, scale = gptq_int8(w, h, group_size=8)
    want_q, want_scale = quantize_rows(w.reshape(-1, 8))
    assert torch.equal(q, want_q.view(24, 40)) and scale.shape == (24, 5)
    torch.testing.assert_close(scale, want_scale.view(24, 5))


def test_the_second_column_takes_up_the_first_ones_error():
    """Inputs of columns 0 and 1 correlate (H01 = 0.9, unit variances); column 2 holds
    the row's max, so the step s is 1/127. Column 0 (10.4 s) rounds to 10, an error of
    0.4 s; the least-squares choice for column 1 is then its own weight plus
    0.4 s * H01 / H11 = 20.3 s + 0.36 s = 20.66 s, which rounds to 21, not 20."""
    s = 1 / 127
    w = torch.tensor([[10.4 * s, 20.3 * s, 1.0]], dtype=torch.float64)
    h = torch.tensor([[1.0, 0.9, 0.0], [0.9, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    q, scale = gptq_int8(w, h, damping=0.0)
    assert q.tolist() == [[10, 21, 127]]
    assert quantize_rows(w)[0].tolist() == [[10, 20, 127]]
    assert scale.item() == pytest.approx(s)


def test_it_leaves_less_output_error_than_rounding_to_nearest():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 64, generator=g, dtype=torch.float64) @ torch.randn(
        64, 64, generator=g, dtype=torch.float64)          # correlated inputs
    w = torch.randn(48, 64, generator=g, dtype=torch.float64)

    def error(q, scale):
        return torch.linalg.norm(x @ (w - q.double() * scale.double()[:, None]).T)

    gptq, nearest = error(*gptq_int8(w, x.T @ x)), error(*quantize_rows(w))
    assert gptq < 0.8 * nearest          # 0.69 here


# ---- the command ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantize(tiny_factory, tmp_path_factory):
    """A tiny checkpoint (llama unless named), with a tokenizer for the calibration text,
    quantized (cached by architecture and ``ignore``)."""
    done = {}

    def get(*ignore: str, arch: str = "llama", weight_only: tuple[str, ...] = ()):
        key = arch, ignore, weight_only
        if key not in done:
            ck = dataclasses.replace(load_checkpoint(tiny_factory(arch).path),
                                     tokenizer=ByteTokenizer())
            out = tmp_path_factory.mktemp("gptq") / "int8"
            done[key] = ck, out, quantize_checkpoint(ck, out, ignore=list(ignore),
                                                     weight_only=list(weight_only))
        return done[key]
    return get


def test_the_checkpoint_loads_int8_with_what_it_ignores_fp(quantize):
    ck, out, report = quantize("re:.*down_proj")
    n = ck.config.num_layers
    assert (report.quantized, report.kept) == (3 * n, n)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", "re:.*down_proj"]
    loaded = load_checkpoint(str(out))
    for i in range(n):
        for kind, modules in FUSED_MODULES.items():
            for m in modules:
                w = loaded.weights[f"model.layers.{i}.{m}.weight"]
                assert w.dtype == (torch.float32 if kind == "down" else torch.int8)
                if kind != "down":
                    assert loaded.weights[f"model.layers.{i}.{m}.weight_scale"].shape == (
                        w.shape[0], 1)
    assert loaded.config == ck.config


@pytest.mark.parametrize("arch", ["llama", "qwen3", "pangu"])   # + q/k norms; + biases
def test_its_logits_are_closer_to_fp32_than_w8a8_at_load(quantize, arch):
    """Held-out text (not the calibration topics): the GPTQ checkpoint against the same
    model quantized at load (SmoothQuant, weights rounded to nearest), both against the
    fp32 model's logits."""
    ck, out, _ = quantize(arch=arch)
    ids = ByteTokenizer().encode(pydoc_data.topics.topics["compound"])[:256]
    fp = logits(ck.config, ck.weights, ids)
    loaded = load_checkpoint(str(out))
    gptq = logits(loaded.config, loaded.weights, ids)
    smoothed = smooth_for_w8a8(ck.config, ck.weights, ck.tokenizer, CPU)
    nearest = logits(ck.config, smoothed, ids, "w8a8")
    assert (gptq - fp).abs().mean() < 0.9 * (nearest - fp).abs().mean()   # 0.71-0.80 here


def test_weight_only_modules_go_into_a_w8a16_group_and_run_as_w8a16(quantize):
    """``--weight-only 're:.*down_proj'``: down_proj packed four weights to a word in a
    pack-quantized W8A16 group, a scale per 64 inputs; the rest W8A8. Loaded, down_proj
    runs as w8a16: the logits are those of the same model with down_proj's stored
    weights dequantized to fp32 (fp activations), and closer to fp32's than with every
    layer w8a8."""
    ck, out, report = quantize(weight_only=("re:.*down_proj",))
    n = ck.config.num_layers
    assert (report.quantized, report.weight_only, report.kept) == (4 * n, n, 0)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    group = config["config_groups"]["group_1"]
    assert (group["targets"], group["format"], group["input_activations"]) == (
        ["re:.*down_proj"], "pack-quantized", None)
    assert (group["weights"]["strategy"], group["weights"]["group_size"]) == ("group", 64)
    stored = load_file(str(out / "model.safetensors"))
    packed = stored["model.layers.0.mlp.down_proj.weight_packed"]
    assert packed.dtype == torch.int32 and packed.shape[1] == ck.config.intermediate_size // 4
    loaded = load_checkpoint(str(out))
    assert loaded.int8_schemes["model.layers.0.mlp.down_proj.weight"] == "w8a16"
    assert loaded.int8_schemes["model.layers.0.mlp.up_proj.weight"] == "w8a8"
    model = LLM(str(out), device="cpu", kv_cache_bytes=1 << 20).engine.runner.model
    assert (model.layers[0].down_w.choice.kind, model.layers[0].gate_up_w.choice.kind) == (
        "w8a16", "w8a8")
    ids = ByteTokenizer().encode(pydoc_data.topics.topics["compound"])[:256]
    fp = logits(ck.config, ck.weights, ids)
    mixed = logits(loaded.config, loaded.weights, ids, int8_schemes=loaded.int8_schemes)
    dequantized = dict(loaded.weights)
    for i in range(n):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        q, scale = dequantized[name].float(), dequantized.pop(name + "_scale")
        assert scale.shape == (q.shape[0], 2)   # w8a16's groups of 64 inputs
        dequantized[name] = (q.view(q.shape[0], 2, -1) * scale[:, :, None]).view(q.shape)
    assert torch.allclose(mixed, logits(ck.config, dequantized, ids), rtol=0, atol=1e-5)
    _, all_int8, _ = quantize()
    every = logits(ck.config, load_checkpoint(str(all_int8)).weights, ids)
    assert (mixed - fp).abs().mean() < (every - fp).abs().mean()


def test_the_engine_serves_it(quantize):
    _, out, _ = quantize()
    llm = LLM(str(out), device="cpu", kv_cache_bytes=1 << 20)
    got = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("ignore,message", [
    (["re:.*k_proj"], "model.layers.0.self_attn.k_proj without the rest of"),
    (["model.layers.1.mlp.up_proj"], "model.layers.1.mlp.up_proj without the rest of"),
])
def test_ignoring_part_of_a_fused_layer_is_refused(tiny_factory, tmp_path, ignore, message):
    ck = dataclasses.replace(load_checkpoint(tiny_factory("llama").path),
                             tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match=message):
        quantize_checkpoint(ck, tmp_path / "out", ignore=ignore)
    assert not (tmp_path / "out").exists()


def test_an_int8_checkpoint_or_a_used_directory_is_refused(quantize, tmp_path):
    ck, out, _ = quantize()
    with pytest.raises(ValueError, match="int8 already"):
        quantize_checkpoint(dataclasses.replace(load_checkpoint(str(out)),
                                                tokenizer=ByteTokenizer()), tmp_path / "x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        quantize_checkpoint(ck, tmp_path / "used")


def test_the_command_writes_a_checkpoint_that_keeps_its_tokenizer_and_dtype(
        tiny_builder, tmp_path, capsys):
    """A bf16 qwen2 (biases on QKV) with its own tokenizer: the fp tensors are written
    in the dtype its config declares, the int8 ones int8, and the tokenizer goes along."""
    from cluster.cli import main
    from tests.cluster.test_tool_serving import SPECIALS, _write_tokenizer

    src = tmp_path / "qwen2"
    src.mkdir()
    tiny_builder("qwen2", src, vocab_size=len(SPECIALS) + 256)
    _write_tokenizer(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    out = tmp_path / "int8"
    assert main(["quantize", "--model", str(src), "--output", str(out)]) == 0
    assert f"serve it with: python -m cluster serve {out}" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert stored["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.float32
    llm = LLM(str(out), device="cpu", kv_cache_bytes=1 << 20)
    got = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 3


def test_a_tokenizer_given_apart_goes_into_the_checkpoint(tiny_builder, tmp_path):
    from cluster.cli import main
    from tests.cluster.test_tool_serving import SPECIALS, _write_tokenizer

    src, tok = tmp_path / "llama", tmp_path / "tokenizer"
    src.mkdir()
    tok.mkdir()
    tiny_builder("llama", src, vocab_size=len(SPECIALS) + 256)
    _write_tokenizer(tok)
    out = tmp_path / "int8"
    assert main(["quantize", "--model", str(src), "--tokenizer", str(tok),
                 "--output", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert load_checkpoint(str(out)).tokenizer is not None


def test_the_command_names_a_missing_tokenizer(tiny_factory, tmp_path, capsys):
    from cluster.cli import main

    assert main(["quantize", "--model", tiny_factory("llama").path,
                 "--output", str(tmp_path / "out")]) == 2
    assert "no tokenizer to read the calibration text with; pass --tokenizer DIR" in (
        capsys.readouterr().err)
