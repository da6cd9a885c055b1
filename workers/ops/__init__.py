"""Device ops behind one interface (see ``base.Ops``)."""

from __future__ import annotations

import torch

from workers.ops.base import AttentionMetadata, Ops, PrefillSegment
from workers.ops.torch_ref import TorchOps

__all__ = ["AttentionMetadata", "Ops", "PrefillSegment", "TorchOps", "get_ops"]


def get_ops(device: torch.device) -> Ops:
    """The ops for a device. The torch reference runs everywhere; device kernels
    plug in here."""
    return TorchOps()
