"""A worker's KV pool memory as an anonymous shared-memory file that peers on its node map.

The segment is a ``memfd`` (no name in ``/dev/shm`` or anywhere else): the kernel frees it
when the last descriptor and mapping go, so a worker killed by SIGKILL leaves nothing
behind, and no cleanup code has to run. A peer on the same node opens it through the
owner's ``/proc/<pid>/fd/<fd>`` and maps it read-only; the inode in the handle tells the
file apart from whatever a reused pid or fd number points at later. A peer's mapping keeps
the pages alive after the owner dies, so a copy in progress finishes on intact memory;
``PeerSegments`` drops mappings of owners that are gone at its next handoff.

Pages are faulted in at creation (the first handoff into a fresh pool would otherwise pay
a fault per page) and backed by huge pages where the system has them: hugetlbfs pages
if any are reserved and this process may fault them in, else transparent huge pages if
shared memory may use them. A node can reserve huge pages that a container's cgroup
does not let it use (Kubernetes sets a pod's hugetlb limit to 0 unless it requests
``hugepages-2Mi``): mapping them succeeds and faulting them fails, which
``MADV_POPULATE_WRITE`` reports as an error, so such a segment falls back to small
pages. Without that advice (Linux < 5.14) the same fault would be a SIGBUS, so there
hugetlbfs is not tried at all.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import select
import threading
from dataclasses import dataclass

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux >= 5.14
_HUGE_PAGE = 2 << 20


class SegmentError(OSError):
    """A peer's segment that cannot be mapped (its owner is gone, or another file)."""


@dataclass(frozen=True)
class SegmentHandle:
    """Where a peer on the same node finds a segment: plain values, so it crosses processes."""

    pid: int
    fd: int
    inode: int
    nbytes: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


class SharedSegment:
    """At least ``nbytes`` of zeroed, pre-faulted shared memory owned by this process
    (``handle.nbytes`` says how many: huge pages round it up)."""

    def __init__(self, nbytes: int, name: str = "kvpool") -> None:
        if nbytes <= 0:
            raise ValueError(f"shared segment size: got {nbytes} bytes; expected > 0")
        self.huge_pages = False
        if hasattr(os, "MFD_HUGETLB"):
            # hugetlbfs files are whole pages, so the segment grows to the next one (the
            # tail unused)
            whole = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
            try:
                self.fd, self.buffer = _map_new(name, whole, os.MFD_HUGETLB)
            except OSError:   # too few pages reserved: refused at mmap
                pass
            else:
                self.huge_pages = _populate_huge(self.fd, self.buffer)
                nbytes = whole if self.huge_pages else nbytes
        if not self.huge_pages:
            self.fd, self.buffer = _map_new(name, nbytes, 0)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self.buffer.madvise(mmap.MADV_HUGEPAGE)   # a no-op where shmem THP is off
            _prefault(self.buffer)
        self.handle = SegmentHandle(os.getpid(), self.fd, os.fstat(self.fd).st_ino, nbytes)

    def close(self) -> None:
        """Unmap and close; views over ``buffer`` must be gone (mmap refuses otherwise)."""
        self.buffer.close()
        os.close(self.fd)


def _map_new(name: str, nbytes: int, flags: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | flags)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def _populate_huge(fd: int, buf: mmap.mmap) -> bool:
    """Fault in a hugetlbfs mapping; False (and the mapping closed) where a fault is
    refused or could not be refused without a SIGBUS (module docstring)."""
    try:
        buf.madvise(_MADV_POPULATE_WRITE)
        return True
    except OSError:
        buf.close()
        os.close(fd)
        return False


def _prefault(buf: mmap.mmap) -> None:
    try:
        buf.madvise(_MADV_POPULATE_WRITE)
    except OSError as e:   # an older kernel: touch one byte per page
        if e.errno != errno.EINVAL:
            raise
        for offset in range(0, len(buf), mmap.PAGESIZE):
            buf[offset] = 0


class PeerSegments:
    """Read-only mappings of peers' segments, each mapped once and kept while its owner lives."""

    def __init__(self) -> None:
        self._maps: dict[SegmentHandle, _Mapping] = {}
        self._lock = threading.Lock()

    def map(self, handle: SegmentHandle) -> mmap.mmap:
        """The peer's segment; raises SegmentError when it is gone or is not that file."""
        with self._lock:
            self._prune()
            mapping = self._maps.get(handle)
            if mapping is None:
                mapping = self._maps[handle] = _open(handle)
            return mapping.buf

    def __len__(self) -> int:
        return len(self._maps)

    def _prune(self) -> None:
        """Drop the mappings of owners that are gone (their memory is freed only then)."""
        for handle in [h for h, m in self._maps.items() if not m.owner_alive()]:
            mapping = self._maps.pop(handle)
            with contextlib.suppress(BufferError):   # a view is still held: unmapped with it
                mapping.buf.close()
            if mapping.owner is not None:
                os.close(mapping.owner)


@dataclass
class _Mapping:
    """A peer's mapped segment and a pidfd of its owner: polling a pidfd (readable once
    the process exits) costs a quarter of a ``stat`` of the owner's ``/proc`` fd path
    (15 against 60 us on cold caches), which every handoff would pay. Without pidfds
    (Linux < 5.3) the path is checked instead."""

    handle: SegmentHandle
    buf: mmap.mmap
    owner: int | None

    def owner_alive(self) -> bool:
        if self.owner is not None:
            return not select.select([self.owner], [], [], 0)[0]
        try:
            return os.stat(self.handle.path).st_ino == self.handle.inode
        except OSError:
            return False


def _open(handle: SegmentHandle) -> _Mapping:
    """Map the peer's segment, after a pidfd of its owner is held: the file is then
    checked to be the segment, so the pidfd is of the process that owns it."""
    try:
        owner = os.pidfd_open(handle.pid)
    except OSError as e:
        if e.errno != errno.ENOSYS:
            raise SegmentError(f"KV segment {handle.path}: cannot open ({e.strerror}); "
                               "its owner has exited") from e
        owner = None
    try:
        return _Mapping(handle, _map_peer(handle), owner)
    except BaseException:
        if owner is not None:
            os.close(owner)
        raise


def _map_peer(handle: SegmentHandle) -> mmap.mmap:
    try:
        fd = os.open(handle.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SegmentError(f"KV segment {handle.path}: cannot open ({e.strerror}); its "
                           "owner has exited or runs as another user") from e
    try:
        st = os.fstat(fd)
        if st.st_ino != handle.inode or st.st_size < handle.nbytes:
            raise SegmentError(f"KV segment {handle.path}: inode {st.st_ino} of "
                               f"{st.st_size} bytes, expected inode {handle.inode} of "
                               f"{handle.nbytes}: its owner has exited")
        return mmap.mmap(fd, handle.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
