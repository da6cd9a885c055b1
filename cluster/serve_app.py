"""The Ray Serve application: an OpenAI-compatible router in front of one cell.

Two deployments: ``LLMCell`` (``cell_deployment``: one replica owning the cell's
workers and scheduler) and ``Router`` (``router``: the autoscaled HTTP front, which
calls the cell's scheduler directly). ``build_app`` is the import path for
``serve run`` and the CLI's ``serve``; this module turns a config into the two bound
deployments.
"""

import dataclasses
from pathlib import Path
from typing import Any

from ray import serve

from cluster.cell_deployment import LLMCell
from cluster.config import (
    ConfigError,
    EngineConfig,
    config_from_dict,
    load_config,
    served_model_name,
    with_default_pools,
    with_overrides,
)
from cluster.router import Router
from workers.loading.checkpoint import DEFAULT_MODEL_FILE


def config_from_args(args: dict[str, Any] | None) -> EngineConfig:
    """The validated config an application's ``args`` name: ``config`` a YAML file or the
    config itself as a mapping (how a Serve config file carries it inline, as the Helm
    chart's ``serveConfigV2`` does: a pod needs no config file), ``model`` overriding its
    model path. A config without worker pools runs 1 prefill + 1 decode worker."""
    args = dict(args or {})
    source = args.pop("config", None)
    if isinstance(source, dict):
        config = config_from_dict(source)
    elif source is None or isinstance(source, str):
        config = load_config(source)
    else:
        raise ConfigError(f"build_app: config: got {source!r}; expected a YAML file path "
                          "or the config as a mapping of sections (model, cache, ...)")
    if "model" in args:
        config = with_overrides(config, {("model", "path"): args.pop("model")})
    if args:
        raise ConfigError(f"build_app: unknown argument(s) {', '.join(sorted(args))}; "
                          "allowed: config, model")
    return with_default_pools(config)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The application for ``serve run cluster.serve_app:build_app config=FILE`` or a
    Serve config file's ``args`` (see ``config_from_args``)."""
    return app_for(config_from_args(args))


def app_for(config: EngineConfig) -> serve.Application:
    """The two deployments for a validated config."""
    sv = config.serving
    cell = LLMCell.bind(dataclasses.asdict(config))
    router = Router.options(
        max_ongoing_requests=sv.max_ongoing_requests,
        autoscaling_config={"min_replicas": sv.min_replicas, "max_replicas": sv.max_replicas,
                            "target_ongoing_requests": sv.target_ongoing_requests})
    root = config.model.path or Path(DEFAULT_MODEL_FILE).name
    return router.bind(cell, dataclasses.asdict(sv), served_model_name(config), root)
