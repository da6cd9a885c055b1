"""Int8 linear layers: W8A8 dynamic and weight-only int8 (w8a16).

Weights are int8 with one symmetric scale per output channel, ``W ~= q * scale[:, None]``
(what compressed-tensors' ``int8`` ``channel`` strategy stores). W8A8 also quantizes
each call's activations per token, asymmetrically: ``x ~= (qx - zx[:, None]) *
sx[:, None]`` with an integer zero point per row (``quantize_activations``), which spends
all 256 levels on the row's own range, where a symmetric scale spans [-max|x|, max|x|]
and leaves the levels past the row's smaller side unused (on the default model: top-1
agreement with HF fp32 about a point higher, perplexity increase halved;
benchmarks/RESULTS.md; the NPU keeps ``npu_dynamic_quant``'s symmetric activations, see
``npu.py``). So ``x @ W.T ~= (qx @ q.T - zx[:, None] *
q.sum(1)[None, :]) * sx[:, None] * scale[None, :]``: the product accumulated exactly in
int32 by ``torch._int_mm`` (oneDNN's VNNI kernels on x86) and the zero point's share
taken off in int32, exactly, with each channel's weight sum kept from load
(vLLM's "azp" form). torch's dynamic-quantized
linear (FBGEMM/oneDNN) was measured too but quantizes activations per tensor, not per
token; ``_weight_int8pack_mm`` ran 10-100x slower than fp32 here (benchmarks/RESULTS.md).
w8a16 keeps 16-bit activations: the reference dequantizes blocks of rows into the
compute dtype for its GEMM; the CPU ops' decode kernel rounds each activation row to
int16 (``packed_weights``), 1/65534 of its largest value, far below the weights' int8
rounding. Its weights quantized at load get a scale per group of
``W8A16_GROUP`` input columns of each output channel (``W ~= q * scale[:, g]``): on the
default model that lifted top-1 agreement with HF fp32 from 96.8% to 97.4% for 1/16 more
bytes (benchmarks/RESULTS.md); w8a8's single int32 product needs one scale per channel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "w8a8", "w8a16")
_QMAX = 127.0
_DEQUANT_ROWS = 256  # output channels dequantized at once by blocked_linear
W8A16_GROUP = 64     # input columns per w8a16 weight scale (where they divide the width)


def head_quantization(quantization: str) -> str:
    """How the LM head is stored under ``quantization``: w8a16 (decode-bound serving)
    keeps it in fp16, half the bytes of the largest matrix an fp32 model reads per
    token; an int8 head costs too much top-1 agreement (benchmarks/RESULTS.md). w8a8
    serves large batches, where converting an fp16 head back to fp32 would cost more
    than its bytes save, so it keeps the head as loaded."""
    return "fp16" if quantization == "w8a16" else "none"


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization: got {name!r}; allowed: {', '.join(QUANTIZATIONS)}")


@dataclass
class Int8Weight:
    """A linear layer's int8 weight [out, in] and fp32 scales, [out] (per channel) or
    [out, in / group] (w8a16 groups of input columns); ``scheme`` is ``w8a8`` or
    ``w8a16``. ``qweight_t`` (w8a8) is the [in, out] layout ``_int_mm`` reads, and
    ``qweight`` then a transposed view of it, not a second copy; ``channel_sums`` (w8a8)
    each output channel's sum of its int8 weights, int32 [out], for the activations'
    zero points."""

    scheme: str
    qweight: torch.Tensor
    scale: torch.Tensor
    qweight_t: torch.Tensor | None = None
    channel_sums: torch.Tensor | None = None

    @classmethod
    def from_int8(cls, scheme: str, qweight: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
        """``scale``: one per output channel ([out] or [out, 1]), or for w8a16 [out, G]
        with G dividing the input width (groups of in / G columns)."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"int8 weight: got {qweight.dtype} of shape {tuple(qweight.shape)}; "
                             "expected a 2-D int8 tensor [out, in]")
        out, inp = qweight.shape
        scale = scale.to(torch.float32)
        groups = scale.shape[1] if scale.dim() == 2 else 1
        if scale.numel() != out * groups or inp % groups or (groups > 1 and scheme != "w8a16"):
            raise ValueError(f"int8 weight scale: got shape {tuple(scale.shape)} for a weight "
                             f"[{out}, {inp}]; expected one per channel, or for w8a16 "
                             "[out, groups] with groups dividing the input width")
        scale = scale.reshape(out, groups) if groups > 1 else scale.reshape(out)
        if scheme == "w8a8":   # one copy in memory: the layout _int_mm reads, and a view
            qt = qweight.t().contiguous()
            return cls(scheme, qt.t(), scale.contiguous(), qt, qweight.sum(1, dtype=torch.int32))
        return cls(scheme, qweight.contiguous(), scale.contiguous())

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]


def w8a16_group_size(in_features: int) -> int | None:
    """Input columns per scale of a w8a16 weight this wide: ``W8A16_GROUP`` where that
    divides the width into several groups, else None (one scale per output channel)."""
    return None if in_features % W8A16_GROUP or in_features == W8A16_GROUP else W8A16_GROUP


def quantize_weight(weight: torch.Tensor, scheme: str) -> Int8Weight:
    """Symmetric int8 of an fp weight [out, in]: per output channel, and for w8a16 per
    ``w8a16_group_size`` input columns."""
    out, inp = weight.shape
    if scheme != "w8a16" or w8a16_group_size(inp) is None:
        q, scale = quantize_rows(weight)
        return Int8Weight.from_int8(scheme, q, scale)
    q, scale = quantize_rows(weight.reshape(-1, W8A16_GROUP))
    return Int8Weight.from_int8(scheme, q.reshape(out, inp), scale.reshape(out, -1))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D tensor: (q int8, scale fp32 [rows]); an all-zero
    row gets scale 1 (q is zero either way)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(xf / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W8A8's per-token int8 of a 2-D tensor, asymmetric: each row's range [lo, hi] =
    [min(x, 0), max(x, 0)] in 255 steps of ``scale`` (1 for an all-zero row), the zero
    point ``zero = -128 - round(lo / scale)`` (in [-128, 127]), ``q = round(x / scale) +
    zero`` clamped to int8 (rounding half to even), so ``x ~= (q - zero) * scale``.
    Returns (q int8, scale fp32 [rows], zero int32 [rows]). Keeping 0 in the range keeps
    the zero point in int8's range, so ``(q - zero) @ w`` fits int32 for any width up to
    2^31 / (255 * 127) = 66,000."""
    xf = x.float()
    lo, hi = torch.aminmax(xf, dim=1)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    zero = -128 - torch.round(lo / scale)
    q = (torch.round(xf / scale[:, None]) + zero[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale, zero.to(torch.int32)


def w8a8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``x`` quantized per token (``quantize_activations``), an
    exact int32 product, the zero points' share taken off in int32, then the scales."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    qx, sx, zx = quantize_activations(x2)
    acc = torch._int_mm(qx, w.qweight_t) - zx[:, None] * w.channel_sums
    out = acc.float().mul_(sx[:, None]).mul_(w.scale)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).reshape(*shape[:-1], w.out_features)


def w8a16_blocked(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with fp activations: int8 weight rows dequantized a block at a
    time."""
    def rows(start: int, stop: int) -> torch.Tensor:
        return dequantize(w.qweight[start:stop], w.scale[start:stop], x.dtype)
    return blocked_linear(x, w.out_features, rows, bias)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [n, in] times their scales, [n] (per channel) or [n, groups] (each
    group of in / groups columns its own), in ``dtype``."""
    scale = scale.to(dtype).reshape(q.shape[0], -1, 1)
    return q.to(dtype).view(q.shape[0], scale.shape[1], -1).mul_(scale).view(q.shape)


def blocked_linear(x: torch.Tensor, out_features: int,
                   rows: Callable[[int, int], torch.Tensor],
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` where ``rows(start, stop)`` gives W's output channels [start,
    stop) in ``x``'s dtype: a block at a time, so a block stays in cache for its product
    and W is never whole in fp32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    for i in range(0, out_features, _DEQUANT_ROWS):
        stop = min(i + _DEQUANT_ROWS, out_features)
        out[:, i:stop] = F.linear(x2, rows(i, stop).to(x.dtype))
    if bias is not None:
        out.add_(bias)
    return out.reshape(*shape[:-1], out_features)
