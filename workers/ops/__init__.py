"""Device ops behind one interface (see ``base.Ops``)."""

from __future__ import annotations

import torch

from workers.ops.base import AttentionMetadata, Ops, PrefillSegment
from workers.ops.torch_ref import TorchOps

__all__ = ["AttentionMetadata", "Ops", "PrefillSegment", "TorchOps", "get_ops", "OPS_BACKENDS"]

OPS_BACKENDS = ("auto", "torch", "npu", "cuda")


def get_ops(device: torch.device, backend: str = "auto") -> Ops:
    """The ops for a device: ``auto`` picks the device's kernels where they exist,
    ``torch`` forces the reference implementation that runs everywhere, ``npu`` the
    torch_npu ops and ``cuda`` the CUDA attention whatever the tensors' device (how CPU
    tests drive them, the NPU's through a fake ``torch_npu``)."""
    if backend not in OPS_BACKENDS:
        raise ValueError(f"ops: got {backend!r}; allowed: {', '.join(OPS_BACKENDS)}")
    if backend == "npu" or (backend == "auto" and device.type == "npu"):
        return _npu_ops()
    if backend == "cuda" or (backend == "auto" and device.type == "cuda"):
        from workers.ops.cuda import CudaOps, load_flash_attn

        return CudaOps(load_flash_attn())
    if device.type == "cpu":
        from workers.ops.cpu_kernels import cpu_ops

        return cpu_ops(backend)
    return TorchOps()


def _npu_ops() -> Ops:
    from workers.device import npu_available
    from workers.ops.npu import NpuOps

    if not npu_available():
        raise RuntimeError("ops: 'npu' needs torch_npu, importable and seeing an NPU; "
                           "install torch_npu matching torch, or use ops: auto")
    import torch_npu

    return NpuOps(torch_npu, torch.npu.get_device_name())  # type: ignore[attr-defined]
