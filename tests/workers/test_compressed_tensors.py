"""Compressed-tensors int8 checkpoints, written here the way llm-compressor stores them
(W8A8: int8 ``weight``, ``weight_scale`` [out, 1] in the model dtype; W8A16:
``weight_packed`` int32 words of four offset bytes, ``weight_scale`` per group,
``weight_shape``; the ``quantization_config`` of config.json, ``lm_head`` ignored), load
with their int8 weights as stored and compute what the same weights dequantized to fp32
and quantized at load (``quantization="w8a8"`` or ``"w8a16"``) compute: quantizing
``q * scale`` again gives back ``q`` and ``scale``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from workers.loading import load_checkpoint
from workers.loading.compressed_tensors import int8_layout, pack_int8, unpack_int8

QUANT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "token", "dynamic": True, "observer": None}}},
}


W8A16_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None, "input_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group",
                    "dynamic": False, "group_size": 64, "observer": "minmax"}}},
}


def packed_word(values: list[int]) -> int:
    """Four int8 values as compressed-tensors packs them, by hand: each plus 128 is a
    byte, the first the lowest; the word read as a signed int32."""
    word = sum((v + 128) << (8 * i) for i, v in enumerate(values))
    return word - (1 << 32) if word >= 1 << 31 else word


def write_checkpoints(src: Path, quantized: Path, dequantized: Path,
                      config: dict = QUANT_CONFIG, group_size: int | None = None,
                      packed: bool = False) -> None:
    """The tiny checkpoint as compressed-tensors int8 (scales per channel, or per
    ``group_size`` input columns; ``packed``: W8A16's int32 words), and the same weights
    dequantized."""
    for d in (quantized, dequantized):
        shutil.copytree(src, d)
        for f in d.glob("model*.safetensors*"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(f))
    stored, plain = {}, {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            out, inp = t.shape
            groups = t.view(out, -1, group_size or inp)
            scale = (groups.abs().amax(dim=2) / 127).to(torch.bfloat16)
            q = torch.round(groups / scale.float()[:, :, None]).clamp(-127, 127).to(torch.int8)
            module = name[:-len("weight")]
            stored[module + "weight_scale"] = scale
            plain[name] = (q.float() * scale.float()[:, :, None]).view(out, inp)
            q = q.view(out, inp)
            if packed:
                words = [[packed_word(q[r, c:c + 4].tolist()) for c in range(0, inp, 4)]
                         for r in range(out)]
                stored[module + "weight_packed"] = torch.tensor(words, dtype=torch.int32)
                stored[module + "weight_shape"] = torch.tensor([out, inp])
            else:
                stored[name] = q
        else:
            stored[name] = plain[name] = t
    save_file(stored, str(quantized / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    hf_config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(hf_config | {"quantization_config":
                                                                   config}))


@pytest.fixture(scope="module")
def checkpoints(tiny_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    write_checkpoints(Path(tiny_factory("llama").path), root / "int8", root / "dequantized")
    return str(root / "int8"), str(root / "dequantized")


def test_int8_weights_load_as_stored(checkpoints):
    ckpt = load_checkpoint(checkpoints[0])
    assert ckpt.weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert ckpt.weights["model.layers.1.mlp.down_proj.weight_scale"].shape[1] == 1
    assert ckpt.weights["lm_head.weight"].dtype == torch.float32


def _same_generations(a_path: str, a_quant: str, b_path: str, b_quant: str) -> None:
    """Greedy tokens equal and top-3 log-probs within 1e-5, over two prompts."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = [LLM(path, device="cpu", kv_cache_bytes=1 << 20, quantization=quant).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
        for path, quant in ((a_path, a_quant), (b_path, b_quant))]
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5)


def test_int8_checkpoint_computes_what_quantizing_at_load_does(checkpoints):
    _same_generations(checkpoints[0], "none", checkpoints[1], "w8a8")


def test_packed_words_unpack_to_the_bytes_they_hold():
    q = torch.tensor([[-128, -1, 0, 127, 5, -7], [1, 2, 3, 4, -128, 127]], dtype=torch.int8)
    words = pack_int8(q)
    assert words.dtype == torch.int32 and words.shape == (2, 2)
    assert words[0, 0].item() == packed_word([-128, -1, 0, 127]) == -8356096
    assert words[1, 1].item() == 255 << 8   # -128, 127, then padding bytes of 0
    assert torch.equal(unpack_int8(words, 6), q)


def test_a_w8a16_checkpoint_loads_its_packed_weights_and_runs_as_w8a16(tiny_factory, tmp_path):
    """llm-compressor's W8A16 preset (pack-quantized, scales per 64 input columns: two
    groups in down_proj, one elsewhere in the tiny model): its layers run as w8a16 with
    no setting (the LM head, which it leaves fp, in the compute dtype), and with
    ``w8a16``'s fp16 head it computes what the dequantized weights quantized by ``w8a16``
    at load (the same grouping) do."""
    write_checkpoints(Path(tiny_factory("llama").path), tmp_path / "int8", tmp_path / "fp",
                      W8A16_CONFIG, group_size=64, packed=True)
    ck = load_checkpoint(str(tmp_path / "int8"))
    assert ck.weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert ck.weights["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 2)
    assert set(ck.int8_schemes.values()) == {"w8a16"}
    assert not any(n.endswith(("weight_packed", "weight_shape")) for n in ck.weights)
    model = LLM(str(tmp_path / "int8"), device="cpu", kv_cache_bytes=1 << 20).engine.runner.model
    assert {w.choice.kind for layer in model.layers for w in (
        layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)} == {"w8a16"}
    assert model.lm_head.choice.kind == "fp32"
    _same_generations(str(tmp_path / "int8"), "w8a16", str(tmp_path / "fp"), "w8a16")


def test_a_module_takes_the_group_that_names_it_before_the_one_for_every_linear():
    config = json.loads(json.dumps(QUANT_CONFIG))
    config["format"] = "mixed-precision"
    config["config_groups"]["group_0"]["format"] = "int-quantized"
    config["config_groups"]["group_1"] = W8A16_CONFIG["config_groups"]["group_0"] | {
        "targets": ["re:.*down_proj", "model.layers.0.self_attn.o_proj"],
        "format": "pack-quantized"}
    layout = int8_layout(config)
    schemes = {m: layout.group_of(f"model.layers.0.{m}.weight").scheme
               for m in ("mlp.down_proj", "self_attn.o_proj", "mlp.up_proj")}
    assert schemes == {"mlp.down_proj": "w8a16", "self_attn.o_proj": "w8a16",
                       "mlp.up_proj": "w8a8"}
    assert layout.group_of("model.layers.1.self_attn.o_proj.weight").scheme == "w8a8"
    assert layout.group_of("lm_head.weight") is None
    del config["config_groups"]["group_0"]
    assert int8_layout(config).group_of("model.layers.0.mlp.up_proj.weight") is None


def test_an_unsupported_scheme_is_refused_naming_it(checkpoints, tmp_path):
    bad = tmp_path / "per-tensor"
    shutil.copytree(checkpoints[0], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights: got \{'strategy': 'tensor'\} for format "
                                         "int-quantized; supported: compressed-tensors int8"):
        load_checkpoint(str(bad))


def _with_activations(checkpoint: str, directory: Path, **settings) -> str:
    """A copy of ``checkpoint`` whose input activations' settings are changed."""
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] |= settings
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_activations_declared_asymmetric_load_like_symmetric_ones(checkpoints, tmp_path):
    """vLLM's "azp" checkpoints: the engine quantizes activations at run time its own way,
    so ``symmetric: false`` loads the same weights; static activation scales do not."""
    asymmetric = load_checkpoint(_with_activations(checkpoints[0], tmp_path / "azp",
                                                   symmetric=False))
    symmetric = load_checkpoint(checkpoints[0])
    assert asymmetric.weights.keys() == symmetric.weights.keys()
    assert all(torch.equal(asymmetric.weights[k], t) for k, t in symmetric.weights.items())
    static = _with_activations(checkpoints[0], tmp_path / "static", dynamic=False)
    with pytest.raises(ValueError, match=r"input_activations: got \{'dynamic': False\}"):
        load_checkpoint(static)
