"""The native copy + CRC32C: its CRC against the ``crc32c`` package (the oracle) on odd
lengths and offsets, the verified block copy per dtype, each through the 32-byte (AVX2)
and the 8-byte path, the build on first use (two processes at once) and the fallback
where it cannot be built."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from kvcache import native_copy
from kvcache.block_checksum import BlockIdError, block_checksums, copy_verified
from kvcache.native_copy import native_copier
from kvcache.shm_transport import _slab_bytes
from tests.kvcache.test_kv_transfer import make_meta
from tests.kvcache.test_shm_transport import shared_pool

REPO = Path(__file__).resolve().parents[2]
BUILDABLE = platform.machine() == "x86_64" and shutil.which("cc") is not None


@pytest.fixture(params=["avx2", "words"])
def native(request):
    """The native copier, its runs moved 32 bytes at a time (AVX2) or 8."""
    copier = native_copier()
    if copier is None:
        pytest.skip("no native copy on this machine")
    if request.param == "avx2" and not copier.avx2_supported:
        pytest.skip("no AVX2 on this CPU")
    saved = copier.avx2
    copier.avx2 = request.param == "avx2"
    yield copier
    copier.avx2 = saved


def aligned(a: np.ndarray, at: int = 32) -> int:
    """The first offset into ``a`` whose address is a multiple of ``at``."""
    return -a.ctypes.data % at


@pytest.mark.skipif(not BUILDABLE, reason="needs x86-64 and a C compiler")
def test_the_native_copy_is_built_where_there_is_a_compiler():
    """CI's machines can build it: the tests of the native path must not skip there."""
    assert native_copier() is not None


LENGTHS = [0, 1, 7, 8, 9, 63, 191, 192, 193, 200, 1000, 1537, 4097, 12289, 50001]


@pytest.mark.parametrize("length", LENGTHS)
def test_copy_crc32c_is_the_packages_crc_at_odd_lengths_and_offsets(native, length):
    rng = np.random.default_rng(length)
    data = rng.integers(0, 256, length + 32, dtype=np.uint8)
    out = rng.integers(0, 256, length + 32, dtype=np.uint8)
    at = aligned(out)   # a destination where the 32-byte stores may be used
    for src_off, dst_off, start in [(0, at, 0), (1, at, 7), (1, 3, 0), (5, 2, 0x12345678),
                                    (7, 7, 1)]:
        src = data[src_off:src_off + length]
        out[:] = rng.integers(0, 256, out.size, dtype=np.uint8)
        guard = out.copy()
        got = native.copy_crc32c(out[dst_off:dst_off + length], src, start)
        assert got == crc32c.crc32c(src.tobytes(), value=start)
        assert np.array_equal(out[dst_off:dst_off + length], src)
        outside = np.r_[0:dst_off, dst_off + length:out.size]
        assert np.array_equal(out[outside], guard[outside])


@pytest.mark.parametrize("block_major", [True, False], ids=["block-major", "layer-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_verified_block_copy_is_bit_exact_and_refuses_a_flipped_byte(native, dtype,
                                                                         block_major):
    """Expected checksums from the sender's side (the ``crc32c`` package over the runs);
    the native copy agrees on every block and finds a block whose source changed, whether
    a block is one run (block-major) or a slab per layer and K/V."""
    meta = make_meta(dtype, (3, 16, 3, 8))   # slabs of 384 elements: 3 lanes and a tail
    seg_s, src = shared_pool(meta, 10, seed=31, block_major=block_major)
    seg_d, dst = shared_pool(meta, 10, seed=32, block_major=block_major)
    s, d = _slab_bytes(src), _slab_bytes(dst)
    src_ids, dst_ids = [7, 1, 9, 4, 0, 5], [2, 8, 0, 6, 3, 9]
    sums = block_checksums(s, src_ids)
    assert copy_verified(s, src_ids, d, dst_ids, sums, threads=2) is None
    assert np.array_equal(d[:, dst_ids], s[:, src_ids])
    for layer_d, layer_s in zip(dst, src, strict=True):
        assert torch.equal(layer_d[:, dst_ids].view(torch.uint8),
                           layer_s[:, src_ids].view(torch.uint8))
    src[2][1, 9].view(torch.uint8).view(-1)[101] ^= 0x01   # block 9 is row 2
    assert copy_verified(s, src_ids, d, dst_ids, sums, threads=1) == 2
    del s, d, src, dst
    seg_s.close()
    seg_d.close()


@pytest.mark.parametrize("src_ids,dst_ids,side,message", [
    ([0, 1], [1, 4], "destination", r"got 1..4; expected ids in \[0, 4\)"),
    ([0, -1], [1, 2], "source", r"got -1..0; expected ids in \[0, 5\)"),
    ([5, 1], [1, 2], "source", r"got 1..5; expected ids in \[0, 5\)"),
    ([0, 1, 2], [3, 0, 3], "destination", r"got \[3, 0, 3\]; expected distinct ids"),
])
def test_block_ids_outside_a_pool_or_a_repeated_destination_are_refused_before_a_byte_moves(
        src_ids, dst_ids, side, message, copy_path):
    """The native copy checks the ids itself (a dozen numpy calls less per handoff);
    either path refuses them with nothing written."""
    src = np.arange(2 * 5 * 64, dtype=np.uint8).reshape(2, 5, 64)
    dst = np.zeros((2, 4, 64), dtype=np.uint8)
    with pytest.raises(BlockIdError, match=message) as refused:
        copy_verified(src, src_ids, dst, dst_ids, np.zeros(len(src_ids), dtype=np.uint64),
                      threads=2)
    assert refused.value.side == side and not dst.any()


_BUILD = ("from kvcache.native_copy import native_copier; c = native_copier(); "
          "print(c.path if c else None)")


def test_two_processes_building_at_once_both_load_one_library(tmp_path):
    if not BUILDABLE:
        pytest.skip("needs x86-64 and a C compiler")
    env = {**os.environ, "LLM_CLUSTER_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and paths == {str(built[0])}   # no scratch directory left


def test_without_a_compiler_the_copy_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    native_copier.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_copy.__name__):
            assert native_copier() is None
    finally:
        native_copier.cache_clear()
    assert "unavailable" in caplog.text and "crc32c package" in caplog.text


def test_the_copy_threads_are_torchs_openmp_threads():
    """The library is an OpenMP program that shares torch's runtime, even loaded before
    anything imports torch: one libgomp in the process, so the copy runs on the threads
    torch keeps awake instead of competing with them."""
    native = native_copier()
    if native is None:
        pytest.skip("no native copy on this machine")
    assert b"libgomp.so.1" in native.path.read_bytes()   # linked with -fopenmp
    probe = ("import json\n"
             "from pathlib import Path\n"
             "from kvcache.native_copy import native_copier\n"
             "assert native_copier() is not None\n"
             "import torch\n"
             "maps = Path('/proc/self/maps').read_text().splitlines()\n"
             "print(json.dumps(sorted({m.split()[-1] for m in maps if 'libgomp' in m})))\n"
             "print(Path(torch.__file__).parent / 'lib')\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()
    gomp, torch_lib = json.loads(out[0]), Path(out[1])
    assert len(gomp) == 1, gomp
    if (torch_lib / "libgomp.so.1").exists():   # pip wheels bundle it
        assert Path(gomp[0]).resolve() == (torch_lib / "libgomp.so.1").resolve(), gomp
