"""Choosing the device a worker computes on.

``torch_npu`` is imported only when asked for or auto-detected, and only if it
imports cleanly: a broken Ascend install raises ImportError, OSError or
RuntimeError at import, and that must mean "no NPU", not a crashed worker.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda", "npu")


@functools.cache
def npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except (ImportError, OSError, RuntimeError, AttributeError) as e:
        log.debug("torch_npu unavailable: %s", e)
        return False


def resolve_device(name: str = "auto") -> torch.device:
    """The torch device for a configured name; ``auto`` prefers npu, then cuda, then cpu."""
    if name not in DEVICES:
        raise ValueError(f"device: got {name!r}; allowed: {', '.join(DEVICES)}")
    if name == "auto":
        if npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch sees no CUDA device; "
                           "use device: cpu or install a CUDA build of torch")
    if name == "npu" and not npu_available():
        raise RuntimeError("device: 'npu' requested but torch_npu is not importable or "
                           "sees no NPU; install torch_npu matching torch, or use device: cpu")
    return torch.device(name)
