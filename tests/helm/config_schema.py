"""The JSON schema of this project's config sections, derived from their dataclasses:
what the chart's values.schema.json must say of ``app.config`` so that ``helm install``
refuses an unknown or mistyped field before a pod starts. The test compares the two;
``python tests/helm/config_schema.py`` prints this one to paste when a field is added."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from cluster.config import EngineConfig

# Fields the chart sets itself from its own values (the worker groups, the Ray cluster).
CHART_OWNED = {("cluster", "pools"), ("cluster", "address")}

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string",
               dict: "object", list: "array"}


def _field_type(tp: Any) -> str | list[str]:
    """``int | None`` → ``["integer", "null"]``; ``dict[str, float]`` → ``"object"``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        names = [_field_type(t) for t in typing.get_args(tp) if t is not type(None)]
        return [*names, "null"] if type(None) in typing.get_args(tp) else names
    return _JSON_TYPES[typing.get_origin(tp) or tp]


def _object_schema(cls: type, path: tuple[str, ...]) -> dict[str, Any]:
    """A dataclass's fields with their JSON types; a nested dataclass (such as
    ``cluster.autoscale``) as an object of its own."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if (*path, f.name) in CHART_OWNED:
            continue
        tp = hints[f.name]
        props[f.name] = (_object_schema(tp, (*path, f.name)) if dataclasses.is_dataclass(tp)
                         else {"type": _field_type(tp)})
    return {"type": "object", "additionalProperties": False, "properties": props}


def engine_config_schema() -> dict[str, Any]:
    """Every section and field of ``EngineConfig`` with its JSON type, nothing else."""
    return _object_schema(EngineConfig, ())


if __name__ == "__main__":
    print(json.dumps(engine_config_schema(), indent=2))
