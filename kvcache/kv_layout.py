"""KV layouts: ND, and Ascend's fractal NZ, with a pure-torch definition of both
directions that serves as the oracle for every device path.

A block's K (or V) in one layer is a matrix A[m, n]: m the token in the block
(``block_size`` rows), n the flattened (kv_head, head_dim) column. ND keeps it row-major,
``(block_size, kv_heads, head_dim)``; the pool layer is ``(2, num_blocks, block_size,
kv_heads, head_dim)``. NZ (what the 310P's paged-attention kernels read) splits the
columns into tiles of ``c0`` and stores tile by tile: ``NZ[n // c0, m, n % c0] = A[m, n]``,
the pool layer ``(2, num_blocks, ceil(kv_heads*head_dim / c0), block_size, c0)``. ``c0``
is one 32-byte fractal row: 16 for fp16/bf16, 32 for int8 (8 for fp32, which no NPU
kernel reads but the definition covers). Rows are padded to a multiple of 16 and columns
to a multiple of ``c0``, with zeros, as the fractal format is.
"""

from __future__ import annotations

import torch

LAYOUT_ND = "nd"
LAYOUT_NZ = "nz"
LAYOUTS = (LAYOUT_ND, LAYOUT_NZ)
_FRACTAL_ROWS = 16
_FRACTAL_BYTES = 32


def nz_tile(dtype: torch.dtype) -> int:
    """``c0``: the elements of one 32-byte fractal row."""
    return _FRACTAL_BYTES // dtype.itemsize


def _ceil_to(x: int, k: int) -> int:
    return -(-x // k) * k


def nd_to_nz(a: torch.Tensor) -> torch.Tensor:
    """``a`` [..., M, N] as NZ [..., ceil(N/c0), ceil16(M), c0], padding zeros."""
    *lead, m, n = a.shape
    c0 = nz_tile(a.dtype)
    mp, np_ = _ceil_to(m, _FRACTAL_ROWS), _ceil_to(n, c0)
    padded = a.new_zeros((*lead, mp, np_))
    padded[..., :m, :n] = a
    return padded.view(*lead, mp, np_ // c0, c0).transpose(-3, -2).contiguous()


def nz_to_nd(z: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The [..., M, N] matrix an NZ tensor [..., N1, M1, c0] holds (padding dropped)."""
    *lead, n1, m1, c0 = z.shape
    if c0 != nz_tile(z.dtype) or n1 * c0 < n or m1 < m:
        raise ValueError(f"NZ tensor of shape {tuple(z.shape)} and {z.dtype} cannot hold a "
                         f"{m}x{n} matrix; expected inner tiles of {nz_tile(z.dtype)}")
    return z.transpose(-3, -2).reshape(*lead, m1, n1 * c0)[..., :m, :n].contiguous()


def block_shape(layout: str, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, ...]:
    """One block's K (or V) of one layer in ``layout``."""
    if layout == LAYOUT_ND:
        return (block_size, num_kv_heads, head_dim)
    if layout == LAYOUT_NZ:
        if block_size % _FRACTAL_ROWS:
            raise ValueError(f"block_size: got {block_size}; the NZ layout needs a multiple "
                             f"of {_FRACTAL_ROWS}")
        c0 = nz_tile(dtype)
        return (-(-num_kv_heads * head_dim // c0), block_size, c0)
    raise ValueError(f"kv layout: got {layout!r}; allowed: {', '.join(LAYOUTS)}")


def convert_blocks(blocks: torch.Tensor, src: str, dst: str, block_size: int,
                   num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``blocks`` [..., *block_shape(src)] as [..., *block_shape(dst)]; bit-exact both
    ways (a permutation plus zero padding)."""
    if src == dst:
        return blocks
    shape = block_shape(src, block_size, num_kv_heads, head_dim, blocks.dtype)
    lead = blocks.shape[:blocks.dim() - len(shape)]
    n = num_kv_heads * head_dim
    if src == LAYOUT_ND and dst == LAYOUT_NZ:
        return nd_to_nz(blocks.reshape(*lead, block_size, n))
    if src == LAYOUT_NZ and dst == LAYOUT_ND:
        return nz_to_nd(blocks, block_size, n).view(*lead, block_size, num_kv_heads, head_dim)
    raise ValueError(f"kv layout: got {src!r} -> {dst!r}; allowed: {', '.join(LAYOUTS)}")
