"""Choosing the device a worker computes on, and the settings that follow from it.

``torch_npu`` is imported only when asked for or auto-detected, and only if it
imports cleanly: a broken Ascend install raises ImportError, OSError or
RuntimeError at import, and that must mean "no NPU", not a crashed worker.

An NPU worker under Ray asks for ``{"NPU": 1}``; Ray then sets
``ASCEND_RT_VISIBLE_DEVICES`` to the NPU it assigned, which the process sees as its
device 0: the worker selects that one.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda", "npu")
# The paged-attention kernels' block size on Ascend (vllm-ascend's 128); 16 elsewhere.
DEFAULT_BLOCK_SIZE = {"npu": 128, "cpu": 16, "cuda": 16}


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
            return _select_npu()
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch sees no CUDA device; "
                           "use device: cpu or install a CUDA build of torch")
    if name == "npu" and not npu_available():
        raise RuntimeError("device: 'npu' requested but torch_npu is not importable or "
                           "sees no NPU; install torch_npu matching torch, or use device: cpu")
    if name == "npu":
        return _select_npu()
    return torch.device(name)


def _select_npu() -> torch.device:
    """The first NPU this process sees: under Ray, the one Ray assigned (its physical id
    is in ``ASCEND_RT_VISIBLE_DEVICES``, renumbered from 0 for the process)."""
    torch.npu.set_device(0)  # type: ignore[attr-defined]
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    log.info("NPU worker on %s (ASCEND_RT_VISIBLE_DEVICES=%s)",
             torch.npu.get_device_name(0), visible)  # type: ignore[attr-defined]
    return torch.device("npu", 0)


def default_block_size(device: str) -> int:
    """The KV block size when the config leaves it unset, for a device name (``auto``
    as it would resolve here)."""
    if device == "auto":
        device = "npu" if npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    return DEFAULT_BLOCK_SIZE[device]
