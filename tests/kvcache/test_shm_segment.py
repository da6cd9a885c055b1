"""The shared segment a worker's host pool lives in (``kvcache/shm_segment.py``): zeroed,
pre-faulted, mapped read-only by a peer, its owner checked with or without pidfds, and
on huge pages where they are reserved and usable."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest

from kvcache.shm_segment import PeerSegments, SharedSegment


def test_segment_is_zeroed_prefaulted_and_mapped_by_a_peer_read_only():
    seg = SharedSegment(3 << 20)
    assert len(seg.buffer) >= 3 << 20 and seg.buffer[:] == bytes(len(seg.buffer))
    assert seg.handle.pid == os.getpid() and not Path(seg.handle.path).name.startswith("/")
    mapped = PeerSegments().map(seg.handle)
    seg.buffer[12345] = 7
    assert mapped[12345] == 7
    with pytest.raises(TypeError):
        mapped[0] = 1


def test_without_pidfds_a_mapping_checks_its_owner_by_path(monkeypatch):
    """Kernels before 5.3 have no pidfd_open: the owner's /proc fd path and inode decide."""
    def no_pidfd(pid: int) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    seg = SharedSegment(1 << 20)
    peers = PeerSegments()
    peers.map(seg.handle)
    mapping = peers._maps[seg.handle]
    assert mapping.owner is None and mapping.owner_alive()
    mapping.handle = dataclasses.replace(seg.handle, inode=seg.handle.inode + 1)
    assert not mapping.owner_alive()


def _free_huge_pages() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(text.split("HugePages_Free:")[1].split()[0]) if "HugePages_Free:" in text else 0


def _need_huge_pages(n: int) -> None:
    """Skip unless n 2 MB pages are free now (earlier tests' segments may hold some)."""
    if _free_huge_pages() < n:
        pytest.skip(f"fewer than {n} free 2 MB huge pages (vm.nr_hugepages): hugetlbfs "
                    "is refused at mmap and the segment takes 4 KB pages")


def test_a_segment_of_any_size_takes_reserved_huge_pages_whole():
    """hugetlbfs files are whole 2 MB pages: a pool of another size still gets them,
    its segment rounded up, and a peer maps all of it."""
    _need_huge_pages(2)
    seg = SharedSegment((3 << 20) + 5)
    assert seg.huge_pages and seg.handle.nbytes == 4 << 20
    mapped = PeerSegments().map(seg.handle)
    seg.buffer[(3 << 20) + 4] = 9
    assert len(mapped) == 4 << 20 and mapped[(3 << 20) + 4] == 9


def test_huge_pages_that_cannot_be_faulted_in_leave_the_segment_on_small_pages(monkeypatch):
    """Reserved pages whose fault is refused (a cgroup's hugetlb limit), or where the
    kernel cannot report the refusal (no MADV_POPULATE_WRITE): small pages, the
    hugetlbfs mapping given back, and the segment still zeroed and faulted in."""
    import kvcache.shm_segment as shm

    _need_huge_pages(2)   # else mmap refuses them, before the fault this is about
    free = _free_huge_pages()
    monkeypatch.setattr(shm, "_MADV_POPULATE_WRITE", 9999)   # EINVAL, as on Linux < 5.14
    seg = SharedSegment((3 << 20) + 5)
    assert not seg.huge_pages and seg.handle.nbytes == (3 << 20) + 5
    assert _free_huge_pages() == free and seg.buffer[:] == bytes(len(seg.buffer))
    mapped = PeerSegments().map(seg.handle)
    seg.buffer[(3 << 20) + 4] = 9
    assert mapped[(3 << 20) + 4] == 9
