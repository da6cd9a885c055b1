"""Checkpoints quantized to int8 by compressed-tensors (llm-compressor), as vLLM loads
them: ``config.json``'s ``quantization_config`` has ``quant_method``
``compressed-tensors`` and config groups of two kinds, each for the linear layers its
``targets`` name:

- W8A8, format ``int-quantized``: int8 weights, symmetric, one scale per output channel
  (``strategy: channel``), and int8 input activations, dynamic per token, symmetric or
  not: the engine quantizes them at run time its own way
  (``quant_linear.quantize_activations``: asymmetric, except on the NPU), so either
  checkpoint runs the same. A layer stores ``<name>.weight`` int8 [out, in] and
  ``<name>.weight_scale`` [out, 1].
- W8A16 (weight-only), format ``pack-quantized`` (llm-compressor's W8A16 preset): the
  same int8 weights per channel or per group of input columns (``strategy: group``,
  ``group_size``), no input activations; a layer stores ``<name>.weight_packed`` int32
  [out, in / 4], four weights to a word, each offset by 128 into a byte, the first in
  the lowest (``unpack_int8``), and ``<name>.weight_scale`` [out, 1] or [out, in /
  group_size]. These run as ``w8a16``.

A module takes the first group whose targets name it (its name, or an ``re:`` pattern)
and otherwise a group that targets ``Linear``; modules in ``ignore`` (usually
``lm_head``) keep fp weights. The int8 tensors are kept as they are (the decoder uses
them directly); nothing passes through fp32. The top-level ``format`` is a group's
default (``mixed-precision`` where the groups differ).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

_SUPPORTED = ("compressed-tensors int8: W8A8 (format int-quantized, symmetric weights per "
              "channel, dynamic int8 activations per token) and W8A16 (format pack-quantized, "
              "symmetric weights per channel or group, no activation quantization)")
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True}
_ACTIVATIONS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
# format -> how its layers run, and the weight strategies it may have
_SCHEMES = {"int-quantized": ("w8a8", ("channel",)),
            "pack-quantized": ("w8a16", ("channel", "group"))}


@dataclass(frozen=True)
class Int8Group:
    """One config group: ``scheme`` ``w8a8`` or ``w8a16``; ``group_size``: input columns
    per weight scale (None: one per output channel)."""

    scheme: str
    targets: tuple[str, ...]
    group_size: int | None

    @property
    def packed(self) -> bool:
        """Weights in ``weight_packed`` words: the one weight-only format (``_SCHEMES``)."""
        return self.scheme == "w8a16"


@dataclass(frozen=True)
class Int8Layout:
    """Which of a checkpoint's linear layers are int8, and how (see the module's
    docstring for the matching rule)."""

    groups: tuple[Int8Group, ...]
    ignored: tuple[str, ...]

    def group_of(self, weight_name: str) -> Int8Group | None:
        """The group of the module of ``<module>.weight``; None where it stays fp."""
        if matches(weight_name, self.ignored):
            return None
        named = (g for g in self.groups if matches(weight_name, g.targets))
        return next(named, None) or next((g for g in self.groups if "Linear" in g.targets),
                                         None)


def int8_layout(quant_config: dict[str, Any] | None) -> Int8Layout | None:
    """The layout of an int8 checkpoint; None for an unquantized one; an error naming the
    unsupported setting and what is supported otherwise."""
    if quant_config is None:
        return None
    method, fmt = quant_config.get("quant_method"), quant_config.get("format")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config: got quant_method {method!r}; "
                         f"supported: {_SUPPORTED}")
    groups = quant_config.get("config_groups") or {}
    if not groups:
        raise ValueError(f"quantization_config.config_groups: none; supported: {_SUPPORTED}")
    return Int8Layout(tuple(_group(name, group, fmt) for name, group in groups.items()),
                      tuple(quant_config.get("ignore") or []))


def _group(name: str, group: dict[str, Any], default_format: str | None) -> Int8Group:
    where = f"quantization_config.config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt not in _SCHEMES:
        raise ValueError(f"{where}: got format {fmt!r}; supported: {_SUPPORTED}")
    scheme, strategies = _SCHEMES[fmt]
    weights = group.get("weights") or {}
    wrong = {k: weights.get(k) for k, v in _WEIGHTS.items() if weights.get(k) != v}
    if weights.get("strategy") not in strategies:
        wrong["strategy"] = weights.get("strategy")
    if wrong:
        raise ValueError(f"{where}.weights: got {wrong} for format {fmt}; "
                         f"supported: {_SUPPORTED}")
    activations = group.get("input_activations")
    if scheme == "w8a8":
        got = activations or {}
        wrong = {k: got.get(k) for k, v in _ACTIVATIONS.items() if got.get(k) != v}
    else:
        wrong = {"input_activations": activations} if activations else {}
    if wrong:
        raise ValueError(f"{where}.input_activations: got {wrong} for format {fmt}; "
                         f"supported: {_SUPPORTED}")
    group_size = weights.get("group_size") if weights["strategy"] == "group" else None
    if group_size is not None and (not isinstance(group_size, int) or group_size < 2):
        raise ValueError(f"{where}.weights.group_size: got {group_size!r}; expected an "
                         "integer of at least 2")
    return Int8Group(scheme, tuple(group.get("targets") or ()), group_size)


def matches(weight_name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether the module of ``<module>.weight`` is one of ``patterns`` (names, or
    ``re:`` regular expressions matched in full)."""
    module = weight_name.removesuffix(".weight")
    return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module
               for p in patterns)


def unpack_int8(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """``weight_packed`` int32 [out, ceil(columns / 4)] as int8 [out, columns]."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & 0xFF
    return (codes.flatten(-2)[..., :columns] - 128).to(torch.int8)


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] as ``weight_packed`` int32 [out, ceil(in / 4)] (``unpack_int8``'s
    inverse)."""
    codes = torch.nn.functional.pad(weight.to(torch.int32) + 128, (0, -weight.shape[1] % 4))
    words = (codes.view(weight.shape[0], -1, 4).to(torch.int64)
             << torch.arange(0, 32, 8, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
