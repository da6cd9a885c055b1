"""The host tier: a worker's second KV block store, outside the device pool's budget.

Middle blocks of sequences in offload mode live here; their summaries stay on the
device (with the sequence, on the worker), so a decode step scores every middle block
without touching host memory and copies back only the blocks it selects. A block moves
whole (every layer) when offloaded, but comes back one (layer, KV head) slice at a time,
since each layer and head selects its own blocks; both copies are ``copy_kv_blocks``, or
the device's own (``Ops.copy_kv_blocks``). Host memory is pinned on accelerators, so the
copies can run asynchronously. Like the device pool, this holds tensors only: the
scheduler decides which host block holds what.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcache.kv_tensors import KVShape
from kvcache.shm_segment import SharedSegment

# (src, src_ids, dst, dst_ids, head): ``copy_kv_blocks``'s signature, which a device's
# ops may implement faster (``Ops.copy_kv_blocks``)
KVBlockCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None],
                       None]


def copy_kv_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                   dst_ids: torch.Tensor, head: int | None = None) -> None:
    """Blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` (distinct) of ``dst``, both
    [2, blocks, block_size, KVH, W] in any block order and on any devices, each list of
    ids on its tensor's device; only KV head ``head``'s rows when given."""
    if head is not None:
        dst[:, dst_ids, :, head] = src[:, src_ids, :, head].to(dst.device, non_blocking=True)
        return
    # index_copy_, not index_select: over a block-major layer (strided) index_select
    # first copies the whole layer (20 ms a layer of 4,000 fp16 blocks, not 0.2). And a
    # blocking `.to`: a device-to-host copy must land before index_copy_ reads it.
    dst.index_copy_(1, dst_ids, src[:, src_ids].to(dst.device))


class HostKVStore:
    def __init__(self, shape: KVShape, num_blocks: int, pin: bool = False,
                 copy: KVBlockCopy = copy_kv_blocks, shared: bool = False) -> None:
        """``copy``: how blocks move between the pool and this store (the device's
        ``Ops.copy_kv_blocks``); ``shared``: in a shared-memory ``segment``, which peers on
        this node copy a handoff's blocks out of, as out of a shared pool. Such a segment
        is faulted in whole at start, as the pool's is and as pinned memory is on an
        accelerator; else offloads and handoffs would pay for its first writes, 0.8 s a
        GB on 4 KB pages of an idle machine and about 2.6 s on a busy one (populating it
        at start: 0.55 s a GB; benchmarks/RESULTS.md)."""
        self.num_blocks = num_blocks
        self.copy = copy
        # A private store is left uninitialised: a host block is always written before it
        # is read, and untouched pages of a large budget cost no memory until the tier
        # fills. Block-major (kv_tensors), as shared pools are, so a handoff copies a
        # block as one run.
        dims = (num_blocks, shape.num_layers, 2, shape.block_size, shape.num_kv_heads,
                shape.head_dim)
        self.segment = None
        if shared and num_blocks:
            count = math.prod(dims)
            self.segment = SharedSegment(count * shape.dtype.itemsize, "kvhost")
            blocks = torch.frombuffer(self.segment.buffer, dtype=shape.dtype,
                                      count=count).view(dims)
        else:
            blocks = torch.empty(dims, dtype=shape.dtype, pin_memory=pin)
        self.kv = blocks.permute(1, 2, 0, 3, 4, 5)   # [L, 2, blocks, bs, KVH, D]

    def offload(self, kv_caches: list[torch.Tensor], device_ids: list[int],
                host_ids: list[int]) -> None:
        """Copy the device blocks' KV (every layer) into host blocks."""
        src = torch.as_tensor(device_ids, device=kv_caches[0].device)
        dst = torch.as_tensor(host_ids)
        for layer, kv in enumerate(kv_caches):
            self.copy(kv, src, self.kv[layer], dst, None)

    def recall(self, layer: int, head: int, kv_cache: torch.Tensor, host_ids: torch.Tensor,
               device_ids: torch.Tensor) -> None:
        """Copy one layer's KV head ``head`` of host blocks into device blocks."""
        self.copy(self.kv[layer], host_ids, kv_cache, device_ids, head)
