"""YAML values into the config's dataclasses, checked against their type hints, with
errors that name the field's path, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from scheduler.protocol import Role


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message names the field."""


def build(cls: type, data: Any, where: str = "") -> Any:
    """``cls`` (a dataclass) from ``data`` (parsed YAML), nested sections built the same
    way; a wrong field, type or value raises ``ConfigError`` naming its path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: got {data!r}; expected a mapping of fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown field(s) {', '.join(map(repr, unknown))}; "
                          f"allowed: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, path)
        else:
            kwargs[name] = _check_type(value, tp, path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{where}.{e}" if where else str(e)) from e


def _check_type(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: got {value!r}; expected a list")
        return [build(item, v, f"{path}[{i}]") if dataclasses.is_dataclass(item)
                else _check_type(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{path}: got {value!r}; expected a mapping of names to values")
        return {k: _check_type(v, item, f"{path}.{k}") for k, v in value.items()}
    allowed = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) \
        else (tp,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool) and isinstance(value, t):
            return value
        if t is Role and isinstance(value, str):
            return value   # the dataclass parses it, naming the roles allowed
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{path}: got {value!r}; expected {names}")
