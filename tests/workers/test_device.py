"""torch_npu is used only when it imports cleanly; a broken install means "no NPU"."""

from __future__ import annotations

import importlib.abc
import sys

import pytest
import torch

from workers import device


class _BrokenNpuFinder(importlib.abc.MetaPathFinder):
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def find_spec(self, name, path=None, target=None):
        if name == "torch_npu":
            raise self.exc
        return None


@pytest.fixture
def broken_npu(monkeypatch):
    def install(exc: Exception) -> None:
        monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
        monkeypatch.setattr(sys, "meta_path", [_BrokenNpuFinder(exc), *sys.meta_path])
        device.npu_available.cache_clear()

    yield install
    device.npu_available.cache_clear()


@pytest.mark.parametrize("exc", [ImportError("no module"), OSError("libascend missing"),
                                 RuntimeError("driver mismatch")])
def test_broken_torch_npu_means_no_npu(broken_npu, exc):
    broken_npu(exc)
    assert device.npu_available() is False
    assert device.resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(RuntimeError, match="torch_npu"):
        device.resolve_device("npu")


def test_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="'tpu'.*auto, cpu, cuda, npu"):
        device.resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        device.resolve_device("cuda")
