"""Activation statistics for SmoothQuant: each decoder linear layer's per-input-channel
max|x| over a fixed calibration text, from the fp32 model.

SmoothQuant (``smoothquant.py``) moves quantization difficulty from activations to
weights channel by channel, so it needs to know which input channels carry large
activations; that is a property of the model, measured once at load on real text. The
text is fixed so that a load is reproducible: the first ``CALIBRATION_TOKENS`` tokens of
Python's "Execution model" chapter (``pydoc_data.topics``, in every CPython install; not
the ``compound`` topic the quality benchmark scores, so the figures there are not fitted
to their own text). The forward is the engine's own decoder with the reference ops in
fp32 (the CPU kernels on CPU, but the linear layers always ``F.linear``), one prefill
over a pool just large enough, recording the inputs of the four fused matrices of every
layer.
"""

from __future__ import annotations

import pydoc_data.topics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.kv_tensors import KVShape
from workers.model_config import ModelArchConfig
from workers.models.decoder import FUSED_MODULES, DecoderLM
from workers.ops import TorchOps, get_ops
from workers.ops.base import AttentionMetadata, Ops, PrefillSegment
from workers.tokenizer import Tokenizer

CALIBRATION_TOPIC = "execmodel"
CALIBRATION_TOKENS = 512
_BLOCK = 16
KINDS = tuple(FUSED_MODULES)


@dataclass
class LayerMaxima:
    """One decoder layer's per-input-channel max|x| (fp32) of each fused linear layer:
    ``qkv`` and ``gate_up`` [hidden], ``o`` [q_size], ``down`` [intermediate]."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def calibration_ids(tokenizer: Tokenizer) -> list[int]:
    """The calibration text's first ``CALIBRATION_TOKENS`` token ids."""
    text = pydoc_data.topics.topics[CALIBRATION_TOPIC]
    return tokenizer.encode(text, add_special_tokens=False)[:CALIBRATION_TOKENS]


class SiteOps:
    """Another backend's ops with the decoder layers' linear layers left fp and the MLP
    unfused, so that a subclass's ``linear`` sees the input of every product; the
    products it acts on are the sites ``register`` names, (layer, kind) by the identity
    of their fp weight."""

    def __init__(self, inner: Ops) -> None:
        self.inner = inner
        self.sites: dict[int, tuple[int, str]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def register(self, model: DecoderLM, skip: Collection[tuple[int, str]] = ()) -> None:
        """Every fused linear layer of ``model`` (``KINDS``) but those in ``skip``."""
        for i, layer in enumerate(model.layers):
            for kind in KINDS:
                if (i, kind) not in skip:
                    self.sites[id(getattr(layer, kind + "_w"))] = (i, kind)

    def pack_linear(self, weight: torch.Tensor, quantization: str = "none") -> torch.Tensor:
        """The fp weight as it is, so that ``linear`` computes it with ``F.linear``: the
        backend's own packing may be whichever kernel a timing at load found fastest, and
        the two round differently, which would make the statistics (and through them
        every rounding of the quantized weights) depend on the machine's load."""
        return weight

    def mlp(self, x: torch.Tensor, gate_up: Any, down: Any) -> torch.Tensor:
        """Unfused, so that both products' inputs pass through ``linear``."""
        return self.linear(self.inner.silu_and_mul(self.linear(x, gate_up)), down)


class _RecordingOps(SiteOps):
    """Keeps the running max|x| per input channel of each registered site."""

    def __init__(self, inner: Ops) -> None:
        super().__init__(inner)
        self.maxima: dict[tuple[int, str], torch.Tensor] = {}

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        site = self.sites.get(id(weight))
        if site is not None:
            amax = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
            old = self.maxima.get(site)
            self.maxima[site] = amax if old is None else torch.maximum(old, amax)
        return self.inner.linear(x, weight, bias)


def calibration_ops(device: torch.device) -> Ops:
    """The CPU kernels on CPU (3-4x the reference ops' speed for this prefill); the
    reference ops elsewhere, since flash-attn and the NPU's attention take no fp32."""
    return get_ops(device) if device.type == "cpu" else TorchOps()


def activation_maxima(cfg: ModelArchConfig, weights: dict[str, torch.Tensor],
                      token_ids: list[int], device: torch.device) -> list[LayerMaxima]:
    """Per layer, the max|x| of each linear layer's input over one fp32 prefill of
    ``token_ids``; ``weights`` are fp (HF names), not changed."""
    if not token_ids:
        raise ValueError("calibration: got no token ids; expected at least one")
    ops = _RecordingOps(calibration_ops(device))
    model = DecoderLM(cfg, weights, ops, len(token_ids), device, torch.float32)
    ops.register(model)
    prefill(model, [token_ids], device)
    return [LayerMaxima(*(ops.maxima[(i, kind)] for kind in KINDS))
            for i in range(cfg.num_layers)]


def prefill(model: DecoderLM, sequences: Sequence[list[int]],
            device: torch.device) -> torch.Tensor:
    """The final hidden states [T, hidden] of ``sequences`` (token ids each), run as one
    prefill over a fresh fp32 pool of their own, their tokens in order."""
    cfg = model.cfg
    counts = [-(-len(s) // _BLOCK) for s in sequences]
    shape = KVShape(cfg.num_layers, _BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                    model.ops.kv_layout)
    kv = model.ops.allocate_kv(shape, sum(counts), device)
    segments, slots, positions, start, first = [], [], [], 0, 0
    for seq, count in zip(sequences, counts):
        n = len(seq)
        blocks = torch.arange(first, first + count, device=device)
        segments.append(PrefillSegment(start, n, n, blocks))
        slots.append(first * _BLOCK + torch.arange(n, device=device))
        positions.append(torch.arange(n, device=device))
        start, first = start + n, first + count
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int64, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64, device=device),
        prefills=segments, block_size=_BLOCK)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
    return model.forward(ids, torch.cat(positions), kv, meta)
