"""A compressed-tensors W8A8 int8 checkpoint, written here the way llm-compressor stores
one (int8 ``weight``, ``weight_scale`` [out, 1] in the model dtype, the
``quantization_config`` of config.json, ``lm_head`` ignored), loads with its int8
weights as stored and computes what the same weights dequantized to fp32 and
quantized at load (``quantization="w8a8"``) compute: quantizing ``q * scale`` again
gives back ``q`` and ``scale``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from workers.loading import load_checkpoint

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


def write_checkpoints(src: Path, quantized: Path, dequantized: Path) -> None:
    """The tiny checkpoint as compressed-tensors int8, and the same weights dequantized."""
    for d in (quantized, dequantized):
        shutil.copytree(src, d)
        for f in d.glob("model*.safetensors*"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(f))
    packed, plain = {}, {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = (t.abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16)
            q = torch.round(t / scale.float()).clamp(-127, 127).to(torch.int8)
            packed[name], packed[name[:-len("weight")] + "weight_scale"] = q, scale
            plain[name] = q.float() * scale.float()
        else:
            packed[name] = plain[name] = t
    save_file(packed, str(quantized / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(config | {"quantization_config":
                                                                QUANT_CONFIG}))


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


def test_int8_checkpoint_computes_what_quantizing_at_load_does(checkpoints):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = []
    for path, quant in ((checkpoints[0], "none"), (checkpoints[1], "w8a8")):
        llm = LLM(path, device="cpu", kv_cache_bytes=1 << 20, quantization=quant)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5)


def test_an_unsupported_scheme_is_refused_naming_it(checkpoints, tmp_path):
    bad = tmp_path / "per-tensor"
    shutil.copytree(checkpoints[0], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights: got \{'strategy': 'tensor'\}; supported: "
                                         "compressed-tensors int-quantized W8A8"):
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
