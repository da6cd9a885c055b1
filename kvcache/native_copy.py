"""The fused KV block copy + CRC32C (``csrc/copy_crc32c.c``), loaded through ctypes.

The C file is compiled once per machine with the system C compiler (``$CC`` or ``cc``)
into the project's cache, keyed by its source and flags, and published whole
(``build_cache.publish``), so tests and workers build it on first use and two processes
building at once do not race. A block copy splits its blocks over OpenMP threads (ctypes
releases the GIL); torch is imported before the library is loaded so that both use one
OpenMP runtime, whose threads torch keeps awake (why that matters: the C file). Where it
cannot be had (not x86-64, no SSE4.2, no compiler, a failed build) ``native_copier()``
is None, the copy takes the numpy + ``crc32c`` path, and the log says which one a
process uses.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (loads torch's OpenMP runtime, which the library then shares)

from kvcache.build_cache import cache_root, publish

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "copy_crc32c.c"
_FLAGS = ("-O3", "-msse4.2", "-fopenmp", "-shared", "-fPIC")
_CHECK = (b"123456789", 0xE3069283)   # CRC32C's published check value
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_INT64, _UINT64 = np.dtype(np.int64), np.dtype(np.uint64)
# kv_copy_blocks_crc32c's outcomes other than a mismatching row (the C file's KV_*)
COPIED, BAD_SOURCE, BAD_DESTINATION, REPEATED_DESTINATION, NO_MEMORY = -1, -2, -3, -4, -5


class NativeCopier:
    """Typed calls into the loaded library; every array is C-contiguous bytes."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._avx2 = ctypes.c_int.in_dll(lib, "kv_copy_avx2")   # -1 until the first copy
        self._copy = lib.kv_copy_crc32c
        self._copy.restype, self._copy.argtypes = ctypes.c_uint32, [_P, _P, ctypes.c_size_t,
                                                                    ctypes.c_uint32]
        self._blocks = lib.kv_copy_blocks_crc32c
        self._blocks.restype = _I64
        self._blocks.argtypes = [_P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_int]

    @property
    def avx2(self) -> bool:
        """Whether runs move 32 bytes at a time (the CPU has AVX2; asked on first use)."""
        if self._avx2.value < 0:   # a copy of nothing makes the library ask the CPU
            self.copy_crc32c(np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8))
        return bool(self._avx2.value)

    @avx2.setter
    def avx2(self, on: bool) -> None:
        """Turn the 32-byte path off (or back on where the CPU has it), to test or
        compare the 8-byte one."""
        if on and not self.avx2_supported:
            raise ValueError("avx2: this CPU has no AVX2")
        self._avx2.value = int(on)

    @property
    def avx2_supported(self) -> bool:
        return "avx2" in _cpu_flags()

    def copy_crc32c(self, dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
        """Copy ``src`` into ``dst`` (same byte length) and return the CRC32C of the bytes,
        continued from ``crc``."""
        if dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError(f"copy_crc32c: {src.nbytes} bytes into {dst.nbytes}; expected "
                             "contiguous arrays of one length")
        return self._copy(dst.ctypes.data, src.ctypes.data, src.nbytes, crc)

    def copy_blocks(self, src: np.ndarray, src_ids: np.ndarray, dst: np.ndarray,
                    dst_ids: np.ndarray, expected: np.ndarray, threads: int) -> int:
        """A verified copy between ``(slabs, blocks, slab_bytes)`` pools (ids int64,
        checksums uint64, one per row) on ``threads`` threads: ``COPIED``, a row whose
        CRC32C is not ``expected``'s, or one of the refusals (``BAD_SOURCE``,
        ``BAD_DESTINATION``, ``REPEATED_DESTINATION``: nothing was copied)."""
        arrays = (src, dst, src_ids, dst_ids, expected)
        if not all(a.flags.c_contiguous for a in arrays) or (
                (src_ids.dtype, dst_ids.dtype, expected.dtype) != (_INT64, _INT64, _UINT64)):
            raise ValueError("copy_blocks: expected C-contiguous (slabs, blocks, slab_bytes) "
                             "pools, as _slab_bytes gives, int64 ids and uint64 checksums")
        got = self._blocks(dst.ctypes.data, dst.shape[1], dst_ids.ctypes.data,
                           src.ctypes.data, src.shape[1], src_ids.ctypes.data,
                           expected.ctypes.data, src.shape[0], src.shape[2], len(src_ids),
                           threads)
        if got == NO_MEMORY:
            raise MemoryError(f"copy_blocks: no memory for the order of {len(src_ids)} blocks")
        return got


@functools.cache
def native_copier() -> NativeCopier | None:
    """The fused copy, built on first use; None (logged once) where it cannot be had."""
    try:
        copier = _load()
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("KV handoff copy: native copy + CRC32C unavailable (%s); using numpy "
                    "and the crc32c package", str(detail).strip()[:500])
        return None
    log.info("KV handoff copy: native copy + CRC32C (%s)", copier.path)
    return copier


def _load() -> NativeCopier:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"CPU {platform.machine()}: the kernel is x86-64 SSE4.2 code")
    if "sse4_2" not in _cpu_flags():
        raise RuntimeError("this CPU has no SSE4.2 (no sse4_2 in /proc/cpuinfo)")
    compiler = os.environ.get("CC", "cc")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:12]
    library = cache_root() / "native" / f"copy_crc32c-{digest}.so"
    if not library.exists():
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set $CC)")

        def compile_in(scratch: Path) -> Path:
            out = scratch / library.name
            subprocess.run([compiler, *_FLAGS, "-o", str(out), str(_SOURCE)], check=True,
                           capture_output=True, text=True)
            return out

        publish(library, compile_in)
    copier = NativeCopier(ctypes.CDLL(str(library)), library)
    data, want = _CHECK
    src = np.frombuffer(data, dtype=np.uint8)
    got = copier.copy_crc32c(np.empty_like(src), src)
    if got != want:
        raise RuntimeError(f"{library}: CRC32C of {data!r} is {got:#010x}, expected "
                           f"{want:#010x}; delete the file to rebuild it")
    return copier


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())
