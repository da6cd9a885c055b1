"""KV handoff copies on a side stream (NPU and CUDA), so decode steps don't wait on them.

A worker's steps run on the device's current (compute) stream. An export or import of a
handoff runs its gathers, scatters and copies on one side stream instead, ordered by
events: the side stream first waits for the work already queued on the compute stream
(the KV it reads was written there, and blocks it overwrites may still be read there),
and the compute stream waits for an import only in the first step that reads the
imported blocks, on the device: the host never blocks for it, and steps that don't touch
those blocks run alongside the copy. An export's batch must be complete on the host
before it is sent, so the export waits for its own side-stream work (not for the compute
stream's). On the CPU there is one stream and none of this applies.

``api`` is ``torch.npu`` or ``torch.cuda``: both have ``Stream``, ``Event``, ``stream``
and ``current_stream`` with the same meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class KVTransferStreams:
    def __init__(self, api: ModuleType | Any) -> None:
        self.api = api
        self.side = api.Stream()
        self._pending: list[tuple[Any, set[int]]] = []   # (import done event, its blocks)

    def _after_queued_steps(self) -> None:
        ready = self.api.Event()
        ready.record(self.api.current_stream())
        self.side.wait_event(ready)

    def export(self, copy: Callable[[], T]) -> T:
        """Run ``copy`` (gather the blocks, copy them to the host) on the side stream;
        returns once its result is on the host."""
        self._after_queued_steps()
        with self.api.stream(self.side):
            result = copy()
            done = self.api.Event()
            done.record(self.side)
        done.synchronize()
        return result

    def import_(self, copy: Callable[[], T], block_ids: Iterable[int]) -> T:
        """Run ``copy`` (write a batch into ``block_ids``) on the side stream; the first
        step that reads those blocks waits for it (``before_step``)."""
        self._after_queued_steps()
        with self.api.stream(self.side):
            result = copy()
            done = self.api.Event()
            done.record(self.side)
        self._pending.append((done, set(block_ids)))
        return result

    def before_step(self, block_ids: Iterable[int]) -> None:
        """Order the compute stream after the pending imports into any of ``block_ids``."""
        wanted = set(block_ids)
        still = []
        for done, ids in self._pending:
            if ids & wanted:
                self.api.current_stream().wait_event(done)
            else:
                still.append((done, ids))
        self._pending = still


def transfer_streams(device: torch.device) -> KVTransferStreams | None:
    """Side-stream transfers for an NPU or CUDA device; None on the CPU."""
    if device.type not in ("npu", "cuda"):
        return None
    return KVTransferStreams(getattr(torch, device.type))
