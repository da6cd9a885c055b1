"""``python -m cluster quantize``: an fp checkpoint (HF directory, ``.gguf`` file or the
embedded default) written as a compressed-tensors W8A8 int8 checkpoint, the format
llm-compressor writes and vLLM and this engine load (``loading/compressed_tensors.py``).

The recipe is llm-compressor's W8A8 one: SmoothQuant (``models/smoothquant.py``, as
``w8a8`` applies at load), then GPTQ (``models/gptq.py``) instead of rounding each
weight to nearest. That takes about a minute for the default model, which is why it is
a step of its own rather than part of every load. Modules named in ``ignore`` (names or
``re:`` patterns, compressed-tensors' rule) keep fp weights and run unquantized; the
LM head always does, as in ``w8a8`` at load. Modules named in ``weight_only`` get int8
weights but no activation quantization (a second, W8A16 config group, which the engine
runs as ``w8a16``): GPTQ then takes their Hessians from the unrounded inputs.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvcache.build_cache import cache_root
from workers.loading import load_checkpoint
from workers.loading.checkpoint import Checkpoint
from workers.loading.compressed_tensors import matches, pack_int8
from workers.loading.gguf_checkpoint import converted_dir
from workers.models.decoder import FUSED_MODULES
from workers.models.gptq import gptq_calibration_ids, gptq_model
from workers.models.smoothquant import smooth_for_w8a8
from workers.ops.quant_linear import w8a16_group_size

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")

_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                 "*.pt", "*.pth", "meta.json")


_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
            "dynamic": False, "group_size": None, "observer": "minmax"}


def quantization_config(ignore: list[str], weight_only: list[str] = (),
                        group_size: int | None = None) -> dict:
    """config.json's ``quantization_config``: int8 weights per channel, int8 activations
    per token, dynamic and asymmetric (what the engine runs, and what GPTQ saw); and for
    the ``weight_only`` modules a W8A16 group (``pack-quantized``, no activations, a
    weight scale per ``group_size`` input columns or per channel)."""
    groups = {"group_0": {
        "targets": ["Linear"], "format": "int-quantized", "output_activations": None,
        "weights": _WEIGHTS,
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": False,
                              "strategy": "token", "dynamic": True, "observer": None}}}
    if weight_only:
        weights = _WEIGHTS | ({"strategy": "group", "group_size": group_size}
                              if group_size else {})
        groups["group_1"] = {"targets": list(weight_only), "format": "pack-quantized",
                             "output_activations": None, "weights": weights,
                             "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision" if weight_only else "int-quantized",
        "quantization_status": "compressed", "ignore": ignore, "kv_cache_scheme": None,
        "config_groups": groups,
    }


@dataclass
class QuantizeReport:
    output: Path
    quantized: int      # fused linear layers in int8
    kept: int           # fused linear layers left fp by ``ignore``
    weight_only: int    # of the int8 ones, those without activation quantization
    calibration_tokens: int
    seconds: float


def fused_sites(num_layers: int, patterns: list[str], option: str) -> set[tuple[int, str]]:
    """The (layer, kind) pairs whose modules ``patterns`` name (``option``: the setting,
    for errors). A fused layer's modules share their input and one product, so the
    patterns take all of them or none."""
    taken = set()
    for i in range(num_layers):
        for kind, modules in FUSED_MODULES.items():
            names = [f"model.layers.{i}.{m}.weight" for m in modules]
            hits = [matches(n, patterns) for n in names]
            if any(hits) and not all(hits):
                split = ", ".join(n.removesuffix(".weight") for n, h in zip(names, hits) if h)
                raise ValueError(f"{option}: {split} without the rest of "
                                 f"{', '.join(modules)}, which share one product; "
                                 "name all of them or none")
            if all(hits):
                taken.add((i, kind))
    return taken


def quantize_checkpoint(checkpoint: Checkpoint, output: Path, ignore: list[str] | None = None,
                        tokenizer_dir: Path | None = None,
                        weight_only: list[str] | None = None) -> QuantizeReport:
    """Write ``checkpoint`` (fp weights, with a tokenizer for the calibration text) to the
    new directory ``output`` as a W8A8 int8 checkpoint, computed on the CPU.
    ``tokenizer_dir``: where the checkpoint's tokenizer came from, when not from its own
    directory; its files go into ``output`` too."""
    start = time.perf_counter()
    cfg, tokenizer = checkpoint.config, checkpoint.tokenizer
    if any(w.dtype == torch.int8 for w in checkpoint.weights.values()):
        raise ValueError(f"model {checkpoint.path}: its weights are int8 already; give the "
                         "fp checkpoint it was made from")
    if tokenizer is None:
        raise ValueError(f"model {checkpoint.path}: no tokenizer to read the calibration text "
                         "with; pass --tokenizer DIR")
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"--output {output}: not empty; give a new directory")
    ignore = ["lm_head", *(p for p in ignore or [] if p != "lm_head")]
    weight_only = list(weight_only or [])
    kept = fused_sites(cfg.num_layers, ignore, "ignore")
    light = fused_sites(cfg.num_layers, weight_only, "weight_only") - kept
    group = _weight_only_group(checkpoint.weights, light)
    weights = smooth_for_w8a8(cfg, checkpoint.weights, tokenizer, _CPU)
    sequences = gptq_calibration_ids(tokenizer)
    int8 = gptq_model(cfg, weights, sequences, _CPU, kept, light, group)
    tensors = {name: t.contiguous().cpu() for name, t in weights.items()}
    for (i, kind), w in int8.items():
        row = 0
        for module in FUSED_MODULES[kind]:
            name = f"model.layers.{i}.{module}"
            rows, cols = tensors.pop(name + ".weight").shape
            q = w.qweight[row:row + rows].contiguous()
            if (i, kind) in light:
                tensors[name + ".weight_packed"] = pack_int8(q)
                tensors[name + ".weight_shape"] = torch.tensor([rows, cols])
            else:
                tensors[name + ".weight"] = q
            tensors[name + ".weight_scale"] = w.scale[row:row + rows].reshape(rows, -1)
            row += rows
    _write(_source_dir(checkpoint), tokenizer_dir, output, tensors,
           quantization_config(ignore, weight_only, group))
    return QuantizeReport(output, len(int8), len(kept), len(light), sum(map(len, sequences)),
                          time.perf_counter() - start)


def _weight_only_group(weights: dict[str, torch.Tensor],
                       sites: set[tuple[int, str]]) -> int | None:
    """The weight-only group's input columns per scale: ``w8a16``'s groups where they
    divide every one of its layers' widths (the config has one group size), else None
    (per channel)."""
    first = {kind: modules[0] for kind, modules in FUSED_MODULES.items()}
    sizes = {w8a16_group_size(weights[f"model.layers.{i}.{first[kind]}.weight"].shape[1])
             for i, kind in sites}
    return sizes.pop() if len(sizes) == 1 else None


def _source_dir(checkpoint: Checkpoint) -> Path:
    """The HF directory whose config and tokenizer files the output copies: the
    checkpoint's own, or a GGUF file's cached conversion."""
    path = Path(checkpoint.path)
    if path.is_dir():
        return path
    return converted_dir(path, cache_root(), require_tokenizer=False).directory


def _write(source: Path, tokenizer_dir: Path | None, output: Path,
           tensors: dict[str, torch.Tensor], quant_config: dict) -> None:
    """The source directory's files other than weights (then ``tokenizer_dir``'s), config.json
    with the quantization config added, and the tensors (fp ones in the dtype the source
    declares), written to a temporary directory that then takes ``output``'s name: a
    failure leaves no half-written checkpoint."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns(*_WEIGHT_FILES))
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, partial, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*_WEIGHT_FILES, "config.json"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quant_config
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    dtype = _declared_dtype(config)
    save_file({n: t if not t.is_floating_point() or n.endswith(".weight_scale") else t.to(dtype)
               for n, t in tensors.items()},
              str(partial / "model.safetensors"), metadata={"format": "pt"})
    if output.exists():
        output.rmdir()      # checked empty above
    partial.rename(output)


def _declared_dtype(config: dict) -> torch.dtype:
    """The float dtype config.json declares (``torch_dtype``, or ``dtype`` as newer
    transformers write it); fp32 when it declares none."""
    name = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def run(model: str | None, output: str, ignore: list[str] | None = None,
        tokenizer: str | None = None, weight_only: list[str] | None = None) -> QuantizeReport:
    """The command: load ``model`` in fp32, quantize it, write ``output``."""
    checkpoint = load_checkpoint(model, torch.float32, tokenizer)
    report = quantize_checkpoint(checkpoint, Path(output).expanduser().resolve(), ignore,
                                 Path(tokenizer).expanduser() if tokenizer else None,
                                 weight_only)
    log.info("quantized %d linear layers (%d of them weight-only; %d kept fp) over %d "
             "calibration tokens in %.0f s", report.quantized, report.weight_only,
             report.kept, report.calibration_tokens, report.seconds)
    return report
