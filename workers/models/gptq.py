"""GPTQ (Frantar et al., 2023) for ``w8a8`` checkpoints: each linear layer's int8 weights
chosen column by column so that the rounding error of the columns done so far is
compensated in the columns still to come, weighted by the layer's inputs, instead of
rounding every weight to its nearest step.

The inputs come from one prefill of calibration text through the model as it will run:
layer by layer, each linear layer is quantized the first time it runs, from the inputs
that the layers before it, already quantized (int8 weights and per-token int8
activations), hand it, and the call returns the int8 product the engine will compute.
So a layer's weights also absorb some of the error upstream. ``H = Q(X)^T Q(X)`` is taken
over the activations as quantized at run time (``quantize_activations``), since those
are what multiply the weights. On the default model it moved w8a8's agreement with HF
fp32 by +0.3 and +1.2 points on two technical texts and by -0.7 on plain English, and
halved the perplexity increase on the first two (benchmarks/RESULTS.md).

The grid is the engine's: symmetric int8, one scale per output channel, ``max|W| / 127``
of the row before GPTQ (weight-only layers: per group of input columns, as ``w8a16``
has, their Hessians from the unrounded inputs). This is an offline step (``python -m
cluster quantize``): about a minute for the default model on two cores, too slow for
every load.
"""

from __future__ import annotations

import pydoc_data.topics
from collections.abc import Collection, Sequence
from typing import Any

import torch

from workers.model_config import ModelArchConfig
from workers.models.calibration import SiteOps, calibration_ops, prefill
from workers.models.decoder import DecoderLM
from workers.ops.base import Ops
from workers.ops.quant_linear import (
    Int8Weight,
    quantize_activations,
    w8a8_linear,
    w8a16_blocked,
)
from workers.tokenizer import Tokenizer

# Chapters of Python's language reference (in every CPython install): none is the
# ``compound`` or ``specialnames`` text the quality benchmark scores, nor a part of them.
GPTQ_TOPICS = ("execmodel", "types", "formatstrings", "string-methods", "typesseq",
               "debugger", "assignment", "comparisons", "import", "calls", "naming",
               "typesmapping")
GPTQ_SEQUENCE_TOKENS = 512
DAMPING = 0.01     # of the Hessian's mean diagonal, added to it
BLOCK = 128        # columns updated together (the lazy batch update)


def gptq_calibration_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """The first ``GPTQ_SEQUENCE_TOKENS`` tokens of each topic long enough to give them."""
    seqs = (tokenizer.encode(pydoc_data.topics.topics[t], add_special_tokens=False)
            for t in GPTQ_TOPICS)
    return [s[:GPTQ_SEQUENCE_TOKENS] for s in seqs if len(s) >= GPTQ_SEQUENCE_TOKENS]


def gptq_int8(weight: torch.Tensor, hessian: torch.Tensor, damping: float = DAMPING,
              block: int = BLOCK, group_size: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as (int8 [out, in], fp32 scale [out], or [out, in /
    group_size] with ``group_size``) minimizing ``|(W - Q) X|`` for inputs with
    ``hessian = X^T X`` [in, in]: columns in order of decreasing ``H_jj`` (act-order), in
    float64, each on its group's grid, fixed from ``weight`` beforehand (static groups, so
    act-order keeps contiguous groups). With ``H`` diagonal nothing is carried between
    columns, and the result is round-to-nearest."""
    w = weight.double().clone()
    h = hessian.double().clone()
    out, n = w.shape
    amax = w.view(out, -1, group_size or n).abs().amax(2)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))     # [out, groups]
    dead = torch.diagonal(h) == 0          # a column no input reaches
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    w, h = w[:, order], h[order][:, order]
    col_scale = scale[:, order // (group_size or n)]                      # [out, n]
    h.diagonal().add_(damping * torch.diagonal(h).mean())
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to later ones.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w)
    for start in range(0, n, block):
        end = min(start + block, n)
        cols, errs = w[:, start:end].clone(), torch.empty(w.shape[0], end - start,
                                                          dtype=w.dtype)
        for j in range(end - start):
            col, step = cols[:, j], col_scale[:, start + j]
            qj = torch.round(col / step).clamp_(-127, 127)
            q[:, start + j] = qj
            err = (col - qj * step) / u[start + j, start + j]
            cols[:, j:] -= err[:, None] * u[start + j, start + j:end][None, :]
            errs[:, j] = err
        w[:, end:] -= errs @ u[start:end, end:]
    return (q[:, torch.argsort(order)].to(torch.int8),
            (scale if group_size else scale[:, 0]).float())


class _GptqOps(SiteOps):
    """Quantizes each registered site the first time it runs, and from then on computes
    it as the engine's reference arithmetic does: w8a8 (``quant_linear.w8a8_linear``),
    or for the ``weight_only`` sites w8a16 (fp activations, ``H = X^T X``, a scale per
    ``group_size`` input columns or per channel)."""

    def __init__(self, inner: Ops, weight_only: Collection[tuple[int, str]],
                 group_size: int | None) -> None:
        super().__init__(inner)
        self.weight_only, self.group_size = weight_only, group_size
        self.done: dict[tuple[int, str], Int8Weight] = {}

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        site = self.sites.get(id(weight))
        if site is None:
            return self.inner.linear(x, weight, bias)
        scheme = "w8a16" if site in self.weight_only else "w8a8"
        if site not in self.done:
            x2 = x.reshape(-1, x.shape[-1])
            if scheme == "w8a8":
                q, s, z = quantize_activations(x2)
                x2 = (q.double() - z[:, None]) * s[:, None].double()
            x2 = x2.double()
            group = self.group_size if scheme == "w8a16" else None
            self.done[site] = Int8Weight.from_int8(
                scheme, *gptq_int8(weight, x2.T @ x2, group_size=group))
        if scheme == "w8a16":
            return w8a16_blocked(x, self.done[site], bias)
        return w8a8_linear(x, self.done[site], bias)


def gptq_model(cfg: ModelArchConfig, weights: dict[str, torch.Tensor],
               sequences: Sequence[list[int]], device: torch.device,
               keep_fp: Collection[tuple[int, str]] = (),
               weight_only: Collection[tuple[int, str]] = (), group_size: int | None = None
               ) -> dict[tuple[int, str], Int8Weight]:
    """Each decoder layer's fused linear layers (``calibration.KINDS``) quantized by GPTQ
    over one prefill of ``sequences``, keyed (layer, kind), as ``w8a8`` or for those in
    ``weight_only`` ``w8a16`` (a scale per ``group_size`` input columns, or per channel);
    those in ``keep_fp`` stay fp (and run fp in the pass too). ``weights``: fp, HF
    names, not changed."""
    ops = _GptqOps(calibration_ops(device), weight_only, group_size)
    longest = max(len(s) for s in sequences)
    model = DecoderLM(cfg, weights, ops, longest, device, torch.float32)
    ops.register(model, skip=keep_fp)
    prefill(model, sequences, device)
    return ops.done
