"""Weights packed for the CPU's weight-streaming kernels (``csrc/packed_linear_cpu.cpp``).

A decode step's linear layers are bound by how fast their weights stream from memory.
Packed, each block of ``BLOCK`` output channels is one sequential run, ``[ceil(out /
BLOCK), ceil(in / cols), BLOCK, cols]`` zero-padded (``cols`` 32 for int8, 16 for fp16),
which the prefetchers follow; row-major rows read a few at a time are as many streams.
The kernels serve decode batches. Larger w8a16 batches take a second copy laid out for
register tiles, 16 channels to a register's lanes (``LaneTiledWeight``), where AVX-512
runs, and otherwise dequantize blocks of the packed weight into the fp32 GEMM
(``run_blocked``), which keeps one copy. W8A8 weights are packed the same way for the
exact int32 product at decode batches (``int8_packed_mm``, equal to ``torch._int_mm``),
and in 64-byte quads of inputs for the AMX and AVX-512 VNNI kernels (``TiledInt8Weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.ops.quant_linear import Int8Weight, blocked_linear, dequantize

BLOCK = 8        # output channels per packed block
INT8_COLS = 32   # int8 weights per channel per packed step (one AVX-512 int16 product)
HALF_COLS = 16   # fp16 weights per channel per packed step (one AVX-512 fp32 vector)
TILE_CHANNELS = 16   # output channels per block of a tiled weight
TILE_K = 64          # inputs per tile of a tiled weight


@dataclass(frozen=True)
class PackedWeight:
    """``data``: the packed int8 or fp16 weight; ``scale`` (int8 only): fp32 [padded out,
    groups], zero for padding channels; the logical shape is [out_features, in_features];
    ``channel_sums`` (w8a8): ``Int8Weight.channel_sums``."""

    data: torch.Tensor
    scale: torch.Tensor | None
    out_features: int
    in_features: int
    channel_sums: torch.Tensor | None = None

    @property
    def channel_scale(self) -> torch.Tensor:
        """The fp32 scale per output channel [out] of a per-channel int8 weight (w8a8)."""
        return self.scale[:self.out_features].view(-1)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Output channels [start, stop) as fp32 [stop - start, in]; ``start`` a multiple
        of ``BLOCK``."""
        blocks = self.data[start // BLOCK:-(-stop // BLOCK)]
        w = blocks.permute(0, 2, 1, 3).reshape(blocks.shape[0] * BLOCK, -1)
        w = (w.float() if self.scale is None
             else dequantize(w, self.scale[start:start + w.shape[0]], torch.float32))
        return w[:stop - start, :self.in_features]


def pack_rows(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """``weight`` [out, in] in the packed layout, zero-padded to whole blocks and steps."""
    out, inp = weight.shape
    padded = F.pad(weight, (0, -inp % cols, 0, -out % BLOCK))
    return (padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // cols, cols)
            .permute(0, 2, 1, 3).contiguous())


def packs_int8(weight: Int8Weight) -> bool:
    """Whether the int8 kernel takes this weight: its scale groups must be whole packed
    steps (a per-channel scale always is)."""
    groups = weight.scale.shape[1] if weight.scale.dim() == 2 else 1
    return groups == 1 or (weight.qweight.shape[1] // groups) % INT8_COLS == 0


def pack_int8(weight: Int8Weight) -> PackedWeight:
    out, inp = weight.qweight.shape
    scale = weight.scale.reshape(out, -1)
    return PackedWeight(pack_rows(weight.qweight, INT8_COLS),
                        F.pad(scale, (0, 0, 0, -out % BLOCK)).contiguous(), out, inp,
                        weight.channel_sums)


def pack_half(weight: torch.Tensor) -> PackedWeight:
    out, inp = weight.shape
    return PackedWeight(pack_rows(weight.half(), HALF_COLS), None, out, inp)


@dataclass(frozen=True)
class TiledInt8Weight:
    """A W8A8 weight for the AMX kernel (``amx``) or the AVX-512 VNNI one
    (``csrc/amx_int8_cpu.cpp``, ``csrc/vnni_int8_cpu.cpp``; the layout in
    ``csrc/int8_tiles.h``): ``data`` int8 [ceil(out / 16), in / 64, 16, 64], zero-padded
    channels, offset by 128 for VNNI, whose unsigned operand it is; fp32
    ``channel_scale`` [out] and int32 ``channel_sums`` [out] (``Int8Weight``'s)."""

    data: torch.Tensor
    channel_scale: torch.Tensor
    channel_sums: torch.Tensor
    out_features: int
    amx: bool

    def sums(self, qx: torch.Tensor) -> torch.Tensor:
        """The exact int32 product of per-token int8 activations [rows, in]."""
        op = torch.ops.llm_cluster.amx_int8_mm if self.amx else torch.ops.llm_cluster.vnni_int8_mm
        return op(qx, self.data, self.out_features)

    def linear(self, qx: torch.Tensor, sx: torch.Tensor, zx: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """That product rescaled by the rows' scales ``sx`` and zero points ``zx`` and the
        channels' scales and sums, as ``dequantize_int32`` does, inside the kernel."""
        op = (torch.ops.llm_cluster.amx_w8a8_linear if self.amx
              else torch.ops.llm_cluster.vnni_w8a8_linear)
        return op(qx, sx, zx, self.data, self.channel_scale, self.channel_sums, bias,
                  self.out_features)


def packs_tiles(weight: Int8Weight) -> bool:
    """Whether the tile kernels take this weight: whole tiles of 64 inputs."""
    return weight.qweight.shape[1] % TILE_K == 0


def pack_tiles(weight: Int8Weight, amx: bool) -> TiledInt8Weight:
    """``weight`` in the tile layout, for the AMX kernel or (``amx`` false) VNNI's."""
    out, inp = weight.qweight.shape
    padded = F.pad(weight.qweight, (0, 0, 0, -out % TILE_CHANNELS))
    tiles = padded.reshape(-1, TILE_CHANNELS, inp // TILE_K, TILE_K // 4, 4)  # [j, c, kk, r, i]
    data = tiles.permute(0, 2, 3, 1, 4).reshape(-1, inp // TILE_K, TILE_K // 4,
                                                 TILE_CHANNELS * 4)
    return TiledInt8Weight((data if amx else data ^ -128).contiguous(), weight.scale,
                           weight.channel_sums, out, amx)


@dataclass(frozen=True)
class LaneTiledWeight:
    """A w8a16 weight for the batch kernels (``csrc/w8a16_tiles_cpu.cpp``), 16 output
    channels to a block so that a widened step of it is 16 channels' lanes: int8
    [ceil(out / 16), in / 2, 16, 2] (each channel's inputs in pairs) with ``scale`` fp32
    [ceil(out / 16), groups, 16], or fp16 [ceil(out / 16), in, 16, 1] (the head) with no
    scale; zero-padded channels."""

    data: torch.Tensor
    scale: torch.Tensor | None
    out_features: int


def packs_lane_tiles(weight: Int8Weight | torch.Tensor) -> bool:
    """Whether the batch kernels take this weight: int8 ones need whole input pairs in
    every scale group."""
    if not isinstance(weight, Int8Weight):
        return True
    groups = weight.scale.shape[1] if weight.scale.dim() == 2 else 1
    return (weight.qweight.shape[1] // groups) % 2 == 0


def pack_lane_tiles(weight: Int8Weight | torch.Tensor) -> LaneTiledWeight:
    """An int8 weight (w8a16) or an fp16 one in the lane-tiled layout."""
    q = weight.qweight if isinstance(weight, Int8Weight) else weight.half()
    out, inp = q.shape
    pad = -out % TILE_CHANNELS
    if not isinstance(weight, Int8Weight):
        data = F.pad(q, (0, 0, 0, pad)).view(-1, TILE_CHANNELS, inp).transpose(1, 2)
        return LaneTiledWeight(data.unsqueeze(-1).contiguous(), None, out)
    data = F.pad(q, (0, 0, 0, pad)).view(-1, TILE_CHANNELS, inp // 2, 2).permute(0, 2, 1, 3)
    scale = F.pad(weight.scale.reshape(out, -1), (0, 0, 0, pad))
    return LaneTiledWeight(data.contiguous(), scale.view(-1, TILE_CHANNELS, scale.shape[1])
                           .transpose(1, 2).contiguous(), out)


def run_lane_tiles(x: torch.Tensor, w: LaneTiledWeight,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 rows [..., in] times the lane-tiled weight: rounded to int16 per row (as
    ``run_int8`` rounds them) for an int8 one, as they are for fp16."""
    if w.scale is None:
        return torch.ops.llm_cluster.half_tiles_linear(x.contiguous(), w.data, bias,
                                                       w.out_features)
    return torch.ops.llm_cluster.int16_tiles_linear(x.contiguous(), w.data, w.scale, bias,
                                                    w.out_features)


def run_int8(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 rows [..., in] times the packed int8 weight, activations rounded to int16 per
    row (CpuOps computes in fp32)."""
    return torch.ops.llm_cluster.int8_weight_linear(x.contiguous(), w.data, w.scale, bias,
                                                    w.out_features)


def run_half(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 rows [..., in] times the packed fp16 weight, widened to fp32 in registers."""
    return torch.ops.llm_cluster.half_weight_linear(x.contiguous(), w.data, bias,
                                                    w.out_features)


def run_blocked(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 GEMM on blocks of output channels dequantized from the packed weight."""
    return blocked_linear(x, w.out_features, w.rows, bias)
