"""The Serve application's ``args``: its config as a YAML file path or inline as a
mapping (how the Helm chart's ``serveConfigV2`` passes it), with the same validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, load_config, with_default_pools
from cluster.serve_app import config_from_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["cpu-1p1d.yaml", "npu-910-1p1d.yaml", "default.yaml"])
def test_an_inline_config_equals_its_file(name):
    path = ROOT / "configs" / name
    inline = yaml.safe_load(path.read_text())
    assert config_from_args({"config": inline}) == config_from_args({"config": str(path)})
    assert config_from_args({"config": inline}) == with_default_pools(load_config(path))


def test_no_config_is_the_default_with_one_prefill_and_one_decode_worker():
    config = config_from_args(None)
    assert [p.role for p in config.cluster.pools] == ["prefill", "decode"]
    assert config.model.path is None


def test_model_overrides_an_inline_config():
    config = config_from_args({"config": {"model": {"path": "/a", "dtype": "bfloat16"}},
                               "model": "/b"})
    assert config.model.path == "/b" and config.model.dtype == "bfloat16"


@pytest.mark.parametrize("args,message", [
    ({"config": {"cache": {"block_size": 20}}},
     "cache.block_size: got 20; allowed: a multiple of 16"),
    ({"config": {"models": {}}}, "unknown field(s) 'models'"),
    ({"config": ["model"]}, "build_app: config: got ['model']; expected a YAML file path "
                            "or the config as a mapping"),
    ({"config": {}, "replicas": 2}, "build_app: unknown argument(s) replicas; allowed: "
                                    "config, model"),
])
def test_bad_args_name_the_field_and_what_is_allowed(args, message):
    with pytest.raises(ConfigError) as e:
        config_from_args(args)
    assert message in str(e.value)
