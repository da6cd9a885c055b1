"""Checkpoints quantized W8A8 int8 by compressed-tensors (llm-compressor), as vLLM loads
them: ``config.json``'s ``quantization_config`` has ``quant_method``
``compressed-tensors``, format ``int-quantized``, and a config group whose weights are
int8, symmetric, one scale per output channel (``strategy: channel``) and whose input
activations are int8, dynamic per token, symmetric or not: the engine quantizes them at
run time its own way (``quant_linear.quantize_activations``: asymmetric, except on the
NPU), so either checkpoint runs the same. Each quantized linear layer stores
``<name>.weight`` as int8 [out, in] and ``<name>.weight_scale`` [out, 1]; modules named
in ``ignore`` (usually ``lm_head``) keep fp weights. The int8 tensors are kept as they
are (the decoder uses them directly); nothing passes through fp32.
"""

from __future__ import annotations

import re
from typing import Any

FORMATS = ("int-quantized",)
_SUPPORTED = ("compressed-tensors int-quantized W8A8: int8 symmetric weights per channel, "
              "dynamic int8 activations per token")
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_ACTIVATIONS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}


def int8_ignored(quant_config: dict[str, Any] | None) -> list[str] | None:
    """The module names (or ``re:`` patterns) left unquantized, when the checkpoint is
    W8A8 int8; None for an unquantized checkpoint; an error naming the unsupported
    setting and what is supported otherwise."""
    if quant_config is None:
        return None
    method, fmt = quant_config.get("quant_method"), quant_config.get("format")
    if method != "compressed-tensors" or fmt not in FORMATS:
        raise ValueError(f"quantization_config: got quant_method {method!r}, format {fmt!r}; "
                         f"supported: {_SUPPORTED}")
    groups = quant_config.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: got {len(groups)} groups; "
                         f"supported: one group, {_SUPPORTED}")
    (name, group), = groups.items()
    for part, want in (("weights", _WEIGHTS), ("input_activations", _ACTIVATIONS)):
        got = group.get(part) or {}
        wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
        if wrong:
            raise ValueError(f"quantization_config.config_groups.{name}.{part}: got {wrong}; "
                             f"supported: {_SUPPORTED}")
    return list(quant_config.get("ignore") or [])


def is_ignored(weight_name: str, ignored: list[str]) -> bool:
    """Whether the module of ``<module>.weight`` is in the ``ignore`` list."""
    module = weight_name.removesuffix(".weight")
    return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module
               for p in ignored)
