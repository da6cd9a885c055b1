"""CPU ops: the torch reference with compiled kernels where a CPU step spends its time.

The reference decode gathers every sequence's whole context out of the block pool
for every layer of every step, which dominates a CPU decode step: the C++ kernel in
``csrc/paged_attention_cpu.cpp`` reads keys and values in place. The reference
norms, rotary, KV writes and MLP activation are each many small torch ops, whose
dispatch and re-reads cost more than their arithmetic at decode batch sizes:
``csrc/fused_ops_cpu.cpp`` does each in one pass, and sparse attention's block selection
is one call per layer (``csrc/block_select_cpu.cpp``). The kernels are built once per
machine with torch's extension builder (g++ and ninja) into the cache directory;
when that is impossible the engine keeps the reference path and says so.

The linear layers, most of a step, run on whichever implementation a short timing at
load finds fastest here, per batch-size range (``linear_choice``): ``F.linear`` (MKL,
which repacks the weight every call and runs AVX2 code on AMD CPUs), oneDNN's packed
fp32 weights (2-3x faster on the AMD EPYC measured, ``python -m cluster bench
decode-step``; slower than MKL at batch 1 on an Intel Xeon), for int8 (w8a16) and fp16
weights the packed weight-streaming kernels or blocked dequantization (``packed_weights``),
and for W8A8's exact int8 product ``torch._int_mm``, the packed row-by-row kernel, or
the tile kernels on processors with AMX or AVX-512 VNNI (``csrc/amx_int8_cpu.cpp``,
``csrc/vnni_int8_cpu.cpp``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcache.block_summary import BlockSelector
from kvcache.build_cache import cache_root, publish
from kvcache.long_context import SUMMARY_KINDS
from workers.ops.base import AttentionMetadata
from workers.ops.fused_decode import FusedDecode, LayerWeights, fuse_decode
from workers.ops.linear_choice import ChosenLinear, LinearChooser, LinearImpl, default_store
from workers.ops.packed_weights import (
    PackedWeight,
    TiledInt8Weight,
    pack_half,
    pack_int8,
    pack_lane_tiles,
    pack_tiles,
    packs_int8,
    packs_lane_tiles,
    packs_tiles,
    run_blocked,
    run_half,
    run_int8,
    run_lane_tiles,
)
from workers.ops.quant_linear import Int8Weight, w8a16_blocked
from workers.ops.torch_ref import TorchOps

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# KV the kernels write and the decode kernel reads
KERNEL_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
# head sizes the prompt-attention kernel is built for
PREFILL_HEAD_SIZES = (64, 128)
_LIBRARY = "llm_cluster_cpu_kernels"


@functools.cache
def onednn_linear_problem() -> str | None:
    """None when oneDNN's packed fp32 linear runs here and agrees with ``F.linear``,
    else why not (a torch built without oneDNN, an op that changed)."""
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*shape, generator=gen) for shape in ((5, 48), (40, 48), (40,)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        problem = (None if torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
                   else "oneDNN's packed linear disagrees with F.linear")
    except (AttributeError, RuntimeError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        log.warning("oneDNN linear layers unavailable (%s); using F.linear", problem)
    return problem


@functools.cache
def kernels_digest() -> str:
    """What names the kernels' sources: their library's key in the cache, and part of
    the linear-layer choices' key (a changed kernel is timed afresh)."""
    files = sorted(_CSRC.iterdir())
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (first time) and load the kernels; returns None on success, else why not.

    A built library loads straight from the cache with no build step and no lock: torch's
    builder locks its directory while ninja runs, and a process killed there (or another
    checkout rebuilding the same sources from other paths) would stall every later load.
    A build runs in a directory of its own; its library is renamed into place whole."""
    try:
        # Keyed by the source too: checkouts with different kernels share one cache.
        library = cache_root() / "torch_ext" / f"torch-{torch.__version__}-{kernels_digest()}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(sorted(_CSRC.iterdir()), library)
    except Exception as e:  # a compiler or ninja problem must not stop the engine
        return f"{type(e).__name__}: {e}"
    return None



def _build(files: list[Path], library: Path) -> None:
    """Compile and load the kernels (torch's builder loads what it built), then publish
    the library at ``library`` for later processes."""
    from torch.utils import cpp_extension

    # ninja comes as a pip package into this environment's bin, which need not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    def compile_in(scratch: Path) -> Path:
        cpp_extension.load(
            name=_LIBRARY, sources=[str(f) for f in files if f.suffix == ".cpp"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"],
            extra_ldflags=["-fopenmp"], build_directory=str(scratch),
            is_python_module=False, verbose=False)
        return scratch / f"{_LIBRARY}.so"

    publish(library, compile_in)


class CpuOps(TorchOps):
    """The reference ops with fp32 activations served by the C++ kernels; other dtypes
    and layouts (fp16 compute, strided q/k norms) keep the reference."""

    name = "cpu"

    def __init__(self, chooser: LinearChooser | None = None) -> None:
        self.chooser = chooser or LinearChooser(store=default_store(kernels_digest()))

    def pack_linear(self, weight: torch.Tensor | Int8Weight,
                    quantization: str = "none") -> torch.Tensor | Int8Weight | ChosenLinear:
        """fp32 weights, and the int8 and fp16 ones quantized from them, get the
        implementation timed fastest here per batch-size range (``linear_choice``); other
        dtypes keep the reference."""
        if not isinstance(weight, Int8Weight) and weight.dtype != torch.float32:
            return super().pack_linear(weight, quantization)
        weight = super().pack_linear(weight, quantization)
        kind, shape = ((weight.scheme, tuple(weight.qweight.shape))
                       if isinstance(weight, Int8Weight)
                       else (_KINDS[weight.dtype], tuple(weight.shape)))
        return self.chooser.choose(weight, kind, shape, self.linear_candidates(weight))

    def linear_candidates(self, weight: torch.Tensor | Int8Weight) -> list[LinearImpl]:
        """The implementations that compute this weight's product here."""
        if isinstance(weight, Int8Weight) and weight.scheme == "w8a8":
            # The same exact int32 product every way, so the choice changes no output.
            candidates = [LinearImpl("int8-mm", _as_is, _w8a8_fused_quant),
                          LinearImpl("int8-packed", pack_int8, _w8a8_fused_quant)]
            tile_kernels = (("int8-amx", True, torch.ops.llm_cluster.amx_int8_available()),
                            ("int8-vnni", False, torch.ops.llm_cluster.vnni_int8_available()))
            candidates += [LinearImpl(name, functools.partial(pack_tiles, amx=amx),
                                      _w8a8_fused_quant)
                           for name, amx, here in tile_kernels if here and packs_tiles(weight)]
            return candidates
        if isinstance(weight, Int8Weight):
            candidates = ([LinearImpl("int8-kernel", pack_int8, run_int8),
                           LinearImpl("dequant", pack_int8, run_blocked)] if packs_int8(weight)
                          else [LinearImpl("dequant", _as_is, w8a16_blocked)])
            return candidates + self._lane_tiles("int16-tiles", weight)
        if weight.dtype == torch.float16:
            return [LinearImpl("fp16-kernel", pack_half, run_half),
                    LinearImpl("dequant", pack_half, run_blocked),
                    *self._lane_tiles("fp16-tiles", weight)]
        candidates = [LinearImpl("mkl", torch.Tensor.contiguous, F.linear)]
        if onednn_linear_problem() is None:
            candidates.append(LinearImpl("onednn", _onednn_pack, _onednn_linear))
        return candidates

    @staticmethod
    def _lane_tiles(name: str, weight: torch.Tensor | Int8Weight) -> list[LinearImpl]:
        """The batch kernel for a w8a16 weight (int8 layers, fp16 head), where it runs."""
        if torch.ops.llm_cluster.w8a16_tiles_available() and packs_lane_tiles(weight):
            return [LinearImpl(name, pack_lane_tiles, run_lane_tiles)]
        return []

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight | ChosenLinear,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, ChosenLinear):
            return weight(x, bias)
        return super().linear(x, weight, bias)

    def fuse_decode(self, layers: Sequence[LayerWeights], final_norm: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int,
                    eps: float) -> FusedDecode | None:
        """w8a16 at the batch sizes where every linear layer runs the packed int8 kernel."""
        return fuse_decode(layers, final_norm, num_heads, num_kv_heads, head_dim, eps,
                           KERNEL_KV_DTYPES)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            return super().rms_norm(x, weight, eps)
        return torch.ops.llm_cluster.rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if h.dtype != torch.float32 or not (h.is_contiguous() and delta.is_contiguous()):
            return super().add_rms_norm(h, delta, weight, eps)
        return h, torch.ops.llm_cluster.add_rms_norm_(h, delta, weight, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype != torch.float32 or cos.dtype != torch.float32:
            return super().rotary(q, k, positions, cos, sin)
        torch.ops.llm_cluster.rotary_(q, k, positions, cos, sin)
        return q, k

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if k.dtype != torch.float32 or kv_cache.dtype not in KERNEL_KV_DTYPES:
            return super().write_kv(k, v, kv_cache, slot_mapping)
        torch.ops.llm_cluster.write_kv(k, v, kv_cache, slot_mapping)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().silu_and_mul(x)
        return torch.ops.llm_cluster.silu_and_mul(x)

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor | Int8Weight | ChosenLinear,
            down: torch.Tensor | Int8Weight | ChosenLinear) -> torch.Tensor:
        """W8A8 in fp32: the gate/up product's rescale, activation and requantization
        for down_proj in one C++ pass (``dequantize_silu_mul_quantize``)."""
        if not (x.dtype == torch.float32 and isinstance(gate_up, ChosenLinear)
                and isinstance(down, ChosenLinear)
                and gate_up.choice.kind == down.choice.kind == "w8a8"):
            return super().mlp(x, gate_up, down)
        gu, dn = gate_up.packed_for(x), down.packed_for(x)
        qx, sx, zx = torch.ops.llm_cluster.quantize_rows_int8(
            x.reshape(-1, x.shape[-1]).contiguous())
        qh, sh, zh = torch.ops.llm_cluster.dequantize_silu_mul_quantize(
            *_int8_product(qx, sx, zx, gu))
        out = _rescaled_product(qh, sh, zh, dn, None)
        return out.reshape(*x.shape[:-1], dn.out_features)

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
        if q.dtype != torch.float32 or q.shape[-1] not in PREFILL_HEAD_SIZES:
            return super().causal_attention(q, k, v, scale)
        return torch.ops.llm_cluster.prefill_attention(q, k, v, scale)

    def read_context(self, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype != torch.float32 or kv_cache.dtype not in KERNEL_KV_DTYPES:
            return super().read_context(kv_cache, block_table, length, dtype)
        return torch.ops.llm_cluster.gather_kv(kv_cache, block_table, length).unbind(0)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if q.dtype != torch.float32 or kv_cache.dtype not in KERNEL_KV_DTYPES:
            return super()._decode(q, kv_cache, meta, scale)
        tables, lens = meta.decode_head_tables, meta.decode_head_lens
        if tables is None:
            tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        return torch.ops.llm_cluster.paged_decode_attention(
            q.contiguous(), kv_cache[0], kv_cache[1], tables, lens, scale)

    def block_selector(self, kind: str) -> BlockSelector:
        return CpuBlockSelector(kind)

    def copy_kv_blocks(self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                       dst_ids: torch.Tensor, head: int | None = None) -> None:
        """In C++ (``csrc/kv_gather_cpu.cpp``) where both sides are host memory."""
        if src.device.type != "cpu" or dst.device.type != "cpu":
            return super().copy_kv_blocks(src, src_ids, dst, dst_ids, head)
        torch.ops.llm_cluster.copy_kv_blocks(src, src_ids.contiguous(), dst,
                                             dst_ids.contiguous(), head)


class CpuBlockSelector:
    """``ExactSelector`` in one C++ call per layer (``csrc/block_select_cpu.cpp``): the
    same scores up to fp32 rounding, equal scores ranking the lower block first."""

    def __init__(self, kind: str) -> None:
        self.kind = SUMMARY_KINDS.index(kind)

    def select(self, queries: torch.Tensor, rows: Sequence[torch.Tensor],
               ks: Sequence[int]) -> list[torch.Tensor]:
        return torch.ops.llm_cluster.select_blocks(queries.float().contiguous(), list(rows),
                                                   list(ks), self.kind)

    def select_into(self, q: torch.Tensor, query_rows: Sequence[int],
                    rows: Sequence[torch.Tensor], ks: Sequence[int],
                    middles: Sequence[torch.Tensor], firsts: Sequence[int],
                    tables: torch.Tensor) -> list[torch.Tensor]:
        """``select`` for the queries ``q[query_rows[i]]``, each row's choice then written
        into ``tables`` [B, KVH, width]: head h of table row ``query_rows[i]``, from column
        ``firsts[i]``, gets the pool blocks ``middles[i]`` [M_i, per_block] of its chosen
        middle blocks, in order. One call where ``select`` needs four ops around it."""
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.float().contiguous()
        return torch.ops.llm_cluster.select_into_tables(q, list(query_rows), list(rows),
                                                        list(ks), self.kind, list(middles),
                                                        list(firsts), tables)


_KINDS = {torch.float32: "fp32", torch.float16: "fp16"}  # linear-choice kinds of fp weights


def _as_is(weight: Int8Weight) -> Int8Weight:
    return weight


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


W8A8Weight = Int8Weight | PackedWeight | TiledInt8Weight   # one weight, three packings


def _w8a8_fused_quant(x: torch.Tensor, weight: W8A8Weight,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``w8a8_linear`` with its per-token quantization and its rescale each in one C++
    pass, on any packing of the weight."""
    shape = x.shape
    qx, sx, zx = torch.ops.llm_cluster.quantize_rows_int8(
        x.reshape(-1, shape[-1]).float().contiguous())
    out = _rescaled_product(qx, sx, zx, weight, bias)
    return out.to(x.dtype).reshape(*shape[:-1], weight.out_features)


def _rescaled_product(qx: torch.Tensor, sx: torch.Tensor, zx: torch.Tensor,
                      weight: W8A8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8's output from quantized activations (scales ``sx``, zero points ``zx``): the
    int32 product rescaled by ``dequantize_int32``, which the tile kernels do as they
    make the sums."""
    if isinstance(weight, TiledInt8Weight):
        return weight.linear(qx, sx, zx, bias)
    return torch.ops.llm_cluster.dequantize_int32(*_int8_product(qx, sx, zx, weight), bias)


def _int8_product(qx: torch.Tensor, sx: torch.Tensor, zx: torch.Tensor, weight: W8A8Weight
                  ) -> tuple[torch.Tensor, ...]:
    """W8A8's exact int32 product, with the rows' scales and zero points and the
    channels' scales and weight sums that rescale it (``dequantize_int32``'s operands)."""
    if isinstance(weight, PackedWeight):
        sums = torch.ops.llm_cluster.int8_packed_mm(qx, weight.data, weight.out_features)
        return sums, sx, zx, weight.channel_scale, weight.channel_sums
    if isinstance(weight, TiledInt8Weight):
        return weight.sums(qx), sx, zx, weight.channel_scale, weight.channel_sums
    return torch._int_mm(qx, weight.qweight_t), sx, zx, weight.scale, weight.channel_sums


def cpu_ops(backend: str) -> TorchOps:
    """``CpuOps`` unless the reference is asked for (backend ``torch`` or
    ``$LLM_CLUSTER_OPS=torch``) or the kernels cannot be built."""
    if backend == "torch" or os.environ.get("LLM_CLUSTER_OPS") == "torch":
        return TorchOps()
    problem = load_cpu_kernels()
    if problem is not None:
        log.warning("CPU kernels unavailable (%s); using the slower torch "
                    "reference ops", problem)
        return TorchOps()
    return CpuOps()
