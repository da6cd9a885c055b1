"""CPU ops: the torch reference with a compiled paged decode attention.

The reference decode gathers every sequence's whole context out of the block pool
for every layer of every step, which dominates a CPU decode step. The C++ kernel
in ``csrc/paged_attention_cpu.cpp`` reads keys and values in place. It is built
once per machine with torch's extension builder (g++ and ninja) into the cache
directory; when that is impossible the engine keeps the reference path and says so.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from workers.loading.checkpoint import cache_root
from workers.ops.base import AttentionMetadata
from workers.ops.torch_ref import TorchOps

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (first time) and load the kernels; returns None on success, else why not."""
    try:
        from torch.utils import cpp_extension

        # ninja comes as a pip package into this environment's bin, which need not be on PATH.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        # Keyed by the source too: checkouts with different kernels share one cache.
        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
        build_dir = cache_root() / "torch_ext" / f"torch-{torch.__version__}-{digest}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="llm_cluster_cpu_kernels", sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"],
            extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
            is_python_module=False, verbose=False)
    except Exception as e:  # a compiler or ninja problem must not stop the engine
        return f"{type(e).__name__}: {e}"
    return None


class CpuOps(TorchOps):
    """The reference ops with decode attention served by the C++ kernel."""

    name = "cpu"

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if q.dtype != torch.float32 or kv_cache.dtype not in KERNEL_DTYPES:
            return super()._decode(q, kv_cache, meta, scale)
        return torch.ops.llm_cluster.paged_decode_attention(
            q.contiguous(), kv_cache[0], kv_cache[1], meta.decode_block_tables,
            meta.decode_seq_lens, scale)


def cpu_ops(backend: str) -> TorchOps:
    """``CpuOps`` unless the reference is asked for (backend ``torch`` or
    ``$LLM_CLUSTER_OPS=torch``) or the kernels cannot be built."""
    if backend == "torch" or os.environ.get("LLM_CLUSTER_OPS") == "torch":
        return TorchOps()
    problem = load_cpu_kernels()
    if problem is not None:
        log.warning("CPU attention kernels unavailable (%s); using the slower torch "
                    "reference ops", problem)
        return TorchOps()
    return CpuOps()
