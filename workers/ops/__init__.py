"""Device ops behind one interface (see ``base.Ops``)."""

from __future__ import annotations

import torch

from workers.ops.base import AttentionMetadata, Ops, PrefillSegment
from workers.ops.torch_ref import TorchOps

__all__ = ["AttentionMetadata", "Ops", "PrefillSegment", "TorchOps", "get_ops", "OPS_BACKENDS"]

OPS_BACKENDS = ("auto", "torch")


def get_ops(device: torch.device, backend: str = "auto") -> Ops:
    """The ops for a device: ``auto`` picks the device's kernels where they exist,
    ``torch`` forces the reference implementation that runs everywhere."""
    if backend not in OPS_BACKENDS:
        raise ValueError(f"ops: got {backend!r}; allowed: {', '.join(OPS_BACKENDS)}")
    if device.type == "cpu":
        from workers.ops.cpu_kernels import cpu_ops

        return cpu_ops(backend)
    return TorchOps()
