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


def test_npu_selected_is_the_one_ray_assigned(fake_npu, monkeypatch, caplog):
    """Ray sets ASCEND_RT_VISIBLE_DEVICES to the NPU it assigned; the process sees it
    as device 0, which the worker selects."""
    state = fake_npu(soc="Ascend910B3")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    with caplog.at_level("INFO", logger="workers.device"):
        dev = device.resolve_device("npu")
    assert dev == torch.device("npu", 0)
    assert [c.args for c in state.calls if c.name == "npu.set_device"] == [{"device": 0}]
    assert "ASCEND_RT_VISIBLE_DEVICES=3" in caplog.text
    assert device.resolve_device("auto") == torch.device("npu", 0)


def test_block_size_defaults_to_128_on_npu(fake_npu):
    from cluster.config import config_from_dict

    assert device.default_block_size("cpu") == 16
    assert config_from_dict({"model": {"device": "npu"}}).block_size == 128
    assert config_from_dict({"model": {"device": "npu"},
                             "cache": {"block_size": 64}}).block_size == 64
    fake_npu()
    assert device.default_block_size("auto") == 128


def test_auto_without_torch_npu_picks_a_block_size_of_16(broken_npu):
    broken_npu(ImportError("no module"))
    assert device.default_block_size("auto") == 16 or torch.cuda.is_available()


def test_npu_kv_budget_is_memory_fraction_of_free_memory(fake_npu):
    from kvcache.config import CacheConfig
    from workers.model_runner import _kv_budget

    state = fake_npu(free_bytes=10 << 30)
    budget = _kv_budget(CacheConfig(memory_fraction=0.25), torch.device("npu", 0))
    assert budget == (10 << 30) // 4
    assert [c.name for c in state.calls] == ["npu.mem_get_info"]


def test_npu_workers_ask_ray_for_one_npu():
    from cluster.config import WorkerPoolConfig
    from cluster.pools import worker_options

    pool = WorkerPoolConfig(role="decode", resources={"CPU": 2})
    assert worker_options(pool, "npu") == {"num_cpus": 2, "num_gpus": 0, "max_restarts": 0,
                                           "resources": {"NPU": 1.0},
                                           "enable_tensor_transport": True}
    assert "resources" not in worker_options(pool, "cpu")
    assert "enable_tensor_transport" not in worker_options(pool, "cpu")
    two = WorkerPoolConfig(role="decode", resources={"CPU": 2, "NPU": 2})
    assert worker_options(two, "npu")["resources"] == {"NPU": 2}
